"""dev/hops.py: the masked multi-hop rows, read back by a solver written here."""

import random

import pytest

from dev.hops import masked_row, masked_vocab
from nanochat.synthetic import HopsSpec


def solve(ids, spec):
    """[(hops, answer id)] of a masked row, computed from its table tokens alone (entry id e = k * (n-1) + v')."""
    n = spec.n_symbols
    letter, digit = n * (n - 1), n * (n - 1) + n
    table = {}
    for e in ids[1:1 + n]:
        k, rest = divmod(e, n - 1)
        table[k] = rest + (rest >= k)  # v' skips k itself: the cycle never maps k to k
    answers = []
    for h_id, x_id in zip(ids[2 + n::2], ids[3 + n::2]):
        y = x_id - letter
        for _ in range(h_id - digit):
            y = table[y]
        answers.append((h_id - digit, letter + y))
    return answers


@pytest.mark.parametrize("spec", [HopsSpec(n_symbols=8, max_hops=4, n_queries=16),
                                  HopsSpec(n_symbols=3, max_hops=1, n_queries=2)], ids=str)
def test_masked_rows_answer_right_and_never_show_an_answer(spec):
    rng = random.Random(0)
    for _ in range(200):
        ids, pos, answers, hops = masked_row(rng, spec)
        assert sorted(ids[1:1 + spec.n_symbols]) == sorted(set(ids[1:1 + spec.n_symbols]))  # each entry once
        assert [(h, a) for h, a in zip(hops, answers)] == solve(ids, spec)
        assert pos == list(range(spec.n_symbols + 3, len(ids), 2))  # predicted at each query's symbol
        assert max(ids) < masked_vocab(spec)
        # no answer is ever an input: after each query's symbol comes the next query's hop digit, and the row ends
        digit = spec.n_symbols * (spec.n_symbols - 1) + spec.n_symbols
        assert all(digit < ids[p + 1] <= digit + spec.max_hops for p in pos[:-1]) and pos[-1] == len(ids) - 1
    assert masked_row(random.Random(1), spec) == masked_row(random.Random(1), spec)
