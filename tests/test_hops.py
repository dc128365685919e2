"""dev/hops.py: the masked multi-hop rows, read back by a solver written here, and the regression test of issue 32: the
default recursion learns lookups that a plain model of its depth per supervision step cannot, and climbs."""

import random

import pytest
import torch

from dev.hops import (
    ANSWERS_VOCAB,
    CHAIN_DIGITS,
    VCHAIN_DIGITS,
    answers_eval_rows,
    answers_row,
    chains_row,
    chains_vocab,
    evaluate,
    masked_row,
    masked_vocab,
    vchains_chance,
    vchains_eval_rows,
    vchains_row,
    vchains_vocab,
)
from dev.hops_quick import CURRICULUM, SPEC, quick_config, trained, validation_rows
from nanochat.data.synthetic import HopsSpec


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


def test_chains_rows_resolve_each_variable_through_its_chain():
    spec = HopsSpec(n_symbols=12, max_hops=3, n_queries=12)
    n, rng = spec.n_symbols, random.Random(0)
    val, var, digit = n * n, n * n + n * CHAIN_DIGITS, n * n + n * CHAIN_DIGITS + n
    depths_seen = set()
    for _ in range(200):
        ids, pos, answers, hops = chains_row(rng, spec)
        statements = ids[1:1 + n]
        binds = {t // n: t % n for t in statements if t < val}  # lhs = rhs
        values = {(t - val) // CHAIN_DIGITS: (t - val) % CHAIN_DIGITS for t in statements if val <= t < var}
        assert len(binds) + len(values) == n and len(values) == n // spec.max_hops  # each variable assigned once
        for p, answer, h in zip(pos, answers, hops):
            x, lookups = ids[p] - var, 1
            while x not in values:
                x, lookups = binds[x], lookups + 1
            assert (answer, h) == (digit + values[x], lookups)
        assert pos == list(range(n + 2, len(ids))) and max(ids) < chains_vocab(spec)  # answers are never inputs
        depths_seen.update(hops)
    assert depths_seen == {1, 2, 3}


def solve_vchains(ids, n):
    """[(lookups, answer digit id)] of a vchains row from its tokens alone: 'b = a' is b*n+a, 'v = d' is
    n*n + v*D + d, a query n*n + n*D + x, answer digit n*n + n*D + n + d; follow x until a digit."""
    val, var = n * n, n * n + n * VCHAIN_DIGITS
    statements = ids[1:1 + n]
    assert ids[1 + n] == var + n + VCHAIN_DIGITS  # the separator
    binds = {t // n: t % n for t in statements if t < val}
    values = {(t - val) // VCHAIN_DIGITS: (t - val) % VCHAIN_DIGITS for t in statements if val <= t < var}
    assert sorted([*binds, *values]) == list(range(n))  # every variable assigned exactly once
    answers = []
    for q in ids[2 + n:]:
        x, lookups = q - var, 1
        while x not in values:
            x, lookups = binds[x], lookups + 1
            assert lookups <= n, "a cycle: some variable never reaches a digit"
        answers.append((lookups, var + n + values[x]))
    return answers


def test_vchains_rows_have_implicit_depth_and_the_evaluation_goes_deeper():
    """Issue 51's implicit-depth rows: every answer is its variable's chain's digit after exactly `hops` lookups
    (an independent solver), the query names the variable alone, training rows stay within max_hops, and the
    evaluation's deepest instances are deeper than any training row, in the same tokens and row length."""
    spec = HopsSpec(n_symbols=10, max_hops=3, n_queries=12)
    n, rng, train_depths = spec.n_symbols, random.Random(0), set()
    for _ in range(500):
        ids, pos, answers, hops = vchains_row(rng, spec)
        assert [(h, a) for h, a in zip(hops, answers)] == solve_vchains(ids, n)
        assert pos == list(range(2 + n, len(ids))) and max(ids) < vchains_vocab(spec)  # answers are never inputs
        train_depths.update(hops)
    assert train_depths == {1, 2, 3}
    rows = vchains_eval_rows(0, 20, spec, 2 * spec.max_hops)
    eval_depths = set()
    for ids, pos, answers, hops in rows:
        assert [(h, a) for h, a in zip(hops, answers)] == solve_vchains(ids, n) and len(ids) == 2 + n + 12
        eval_depths.update(hops)
    assert max(eval_depths) == 6 > max(train_depths) and eval_depths == set(range(1, 7))
    chance = vchains_chance(rows, spec)
    assert all(0.1 < c < 0.5 for c in chance.values())  # a digit of the row's chains, at random
    train_tokens = {t for _ in range(3000) for t in vchains_row(rng, spec)[0]}
    assert {t for r in rows for t in r[0]} <= train_tokens  # the deeper rows are made of ids training has


def solve_answers(ids):
    """[(hops, answer id)] of a pairs-and-answers row from the issue's vocabulary alone: BOS=0, SEP=1, EQ=2, S[x]=3+x,
    K[k]=10+k, P[a][b]=21+8a+b; queries SEP S[x] K[k] EQ, each answered by the token after EQ."""
    assert ids[0] == 0
    table = {}
    for t in ids[1:9]:
        a, b = divmod(t - 21, 8)
        table[a] = b
    answers = []
    for i in range(9, len(ids), 5):
        sep, s, k, eq = ids[i:i + 4]
        assert (sep, eq) == (1, 2)
        y = s - 3
        for _ in range(k - 10):
            y = table[y]
        answers.append((k - 10, 3 + y))
    return answers, table


def test_answers_rows_answer_right_and_show_earlier_answers():
    spec = HopsSpec(n_symbols=8, max_hops=4, n_queries=8)
    rng = random.Random(0)
    hops_seen = set()
    for _ in range(300):
        ids, pos, answers, hops = answers_row(rng, spec)
        assert len(ids) == 48 and max(ids) < ANSWERS_VOCAB == 85
        solved, table = solve_answers(ids + [answers[-1]])
        assert [(h, a) for h, a in zip(hops, answers)] == solved
        # one cycle through all 8 symbols: walking 8 steps from 0 visits each once
        walk = [0]
        for _ in range(7):
            walk.append(table[walk[-1]])
        assert sorted(walk) == list(range(8)) and table[walk[-1]] == 0
        assert pos == [12 + 5 * i for i in range(8)] and all(ids[p] == 2 for p in pos)
        assert [ids[p + 1] for p in pos[:-1]] == answers[:-1]  # earlier answers stand in the input
        hops_seen.update(hops)
    assert hops_seen == {1, 2, 3, 4}
    rows = answers_eval_rows(7, 5, spec)
    assert [set(r[3]) for r in rows] == [{k} for k in range(1, 5) for _ in range(5)]
    assert all([(h, a) for h, a in zip(r[3], r[2])] == solve_answers(r[0] + [r[2][-1]])[0] for r in rows)
    assert answers_row(random.Random(1), spec) == answers_row(random.Random(1), spec)
    hidden, shown = answers_row(random.Random(2), spec, hide=True), answers_row(random.Random(2), spec)
    assert [hidden[0][p + 1] for p in hidden[1][:-1]] == [85] * 7  # the ablation: a blank where each answer stood
    assert [t for i, t in enumerate(hidden[0]) if i - 1 not in hidden[1]] == \
        [t for i, t in enumerate(shown[0]) if i - 1 not in shown[1]] and hidden[1:] == shown[1:]


# The regression budget: 800 steps of 32 rows (at 400 the curriculum's shallow first half leaves too little deep
# training for the answer to hold: dev/LOG.md, issue 57).
STEPS = 800


def test_the_default_recursion_uses_its_depth_and_holds_past_its_trained_steps():
    """Issue 32's failure must not come back silently, nor issue 51's drift: one block with the default recursion and
    its step-count curriculum answers 3 chained lookups by its last supervision step, its steps climb to it from a
    first step that cannot, and run to 4x the trained steps it keeps the answer.

    The bounds clear the spread measured over seeds 0-3 under three numerics (this CPU's kernels, ATen's scalar ones,
    MKL's compatible path: what another machine's rounding does to a run): 3 hops at step N 1.00 in all 10 runs
    (bound 0.9), the climb from step 1 0.32-0.44 (bound 0.2), the drop from N to 4N 0.00-0.02 (bound 0.05). At 400
    steps, as this test ran before, the drop spread 0.02-0.18 and another machine failed it (dev/LOG.md, issue 57).
    The plain block is not trained here: by 800 steps it answers 3 hops on some seeds (0.61-0.99), so the climb within
    one model is the check that the steps are used; dev/runcpu_hops.sh shows the contrast at the demo's size. One
    thread, so that the numbers do not depend on the runner (-n 2, OMP_NUM_THREADS)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        val = validation_rows()
        longest = SPEC.max_hops - 1
        default = trained(quick_config(val), steps=STEPS, depth_warmup=CURRICULUM["default"])
        n = default.config.n_sup_train
        acc, _ = evaluate(default, val, 4 * n, SPEC.max_hops)
    finally:
        torch.set_num_threads(threads)
    assert acc[n - 1, longest] >= 0.9, acc
    assert acc[n - 1, longest] - acc[0, longest] >= 0.2, acc  # it climbs across its steps
    assert acc[4 * n - 1, longest] >= acc[n - 1, longest] - 0.05, acc  # thinking longer does not unlearn it


def test_packed_rows_cut_the_stream_as_the_loader_does():
    """--pack: rows of T+1 tokens cut from the <|bos|>-first document stream, as nanochat/data/dataloader.py does."""
    import dev.hops
    from nanochat.data.synthetic import pairs_answers
    from nanochat.data.tokenizer import RustBPETokenizer
    tok, spec = RustBPETokenizer.byte_level(), HopsSpec(n_symbols=6, max_hops=3, n_queries=24)
    dev.hops.FORMAT.update(name="pairs", answers=pairs_answers)
    rows = dev.hops.packed_rows(0, spec, tok, 4, 128)
    bos = tok.get_bos_token_id()
    stream = [t for d in dev.hops.documents("0:pack:0", 64, spec) for t in tok.encode(d, prepend=bos)]
    for i in range(2):
        idx, targets = next(rows)
        window = torch.tensor(stream[i * 4 * 129:(i + 1) * 4 * 129]).view(4, 129)
        assert torch.equal(idx, window[:, :-1]) and torch.equal(targets, window[:, 1:])
    assert (idx[:, 0] == tok.get_bos_token_id()).sum() < 4  # some rows start inside a document: the gap of issue 36


def test_documents_per_row_keeps_every_document_whole():
    """--docs_per_row K: the step's documents K to a row, each whole and <|bos|>-led, none cut or lost."""
    import dev.hops
    from nanochat.data.synthetic import pairs_answers
    from nanochat.data.tokenizer import RustBPETokenizer
    tok, spec = RustBPETokenizer.byte_level(), HopsSpec(n_symbols=6, max_hops=3, n_queries=24)
    dev.hops.FORMAT.update(name="pairs", answers=pairs_answers)
    docs = dev.hops.documents("0:0", 8, spec)
    idx, targets, _, _ = dev.hops.batches(docs, tok)
    idx, targets = dev.hops.documents_per_row(idx, targets, 4)
    bos = tok.get_bos_token_id()
    for r in range(2):
        row = [t for d in docs[4 * r:4 * r + 4] for t in tok.encode(d, prepend=bos)]
        assert idx[r].tolist() == row[:-1] and targets[r].tolist() == row[1:]


def test_row_offset_puts_unscored_filler_before_each_document():
    from dev.hops import offset_rows
    idx, targets = torch.tensor([[0, 5, 6]]), torch.tensor([[5, 6, 7]])
    x, y = offset_rows(idx, targets, 2, filler=0)
    assert x.tolist() == [[0, 0, 0, 5, 6]] and y.tolist() == [[-1, -1, 5, 6, 7]]


@pytest.mark.parametrize("script", ["dev/hops_demo.py", "dev/hops_base_gpu.sh"])
def test_the_hops_scripts_train_one_whole_document_per_row(script):
    """base_train's loader cuts rows of max_seq_len+1 tokens from the document stream: the hops scripts' max_seq_len
    must make each row exactly one document (<|bos|> + its characters, every document of a spec one length), as
    dev/hops.py trains. Rows of 129 tokens held document fragments and kept the recursion on the plateau (issue 36).
    dev/runcpu_hops.sh runs dev/hops_demo.py, whose flags are these."""
    import pathlib
    import re

    from nanochat.data.synthetic import hops_documents
    text = (pathlib.Path(__file__).parent.parent / script).read_text()
    symbols, max_hops = (int(re.search(rf"--{flag}=(\d+)", text).group(1)) for flag in ("hops_symbols", "hops_max"))
    seq_len, rows, batch = (int(re.search(rf"--{flag}=(\d+)", text).group(1))
                            for flag in ("max_seq_len", "device_batch_size", "total_batch_size"))
    lengths = {len(d) for d in hops_documents(0, 50, HopsSpec(symbols, max_hops, 24), family="hops_pairs")}
    assert lengths == {seq_len}, f"{script}: --max_seq_len={seq_len}, documents are <|bos|> + {lengths} characters"
    assert batch == rows * seq_len


def test_hops_repeats_marks_a_query_asked_before():
    """dev/hops_repeats: a query is a repeat when the same hop count and start stood earlier in the document."""
    from dev.hops_repeats import first_times
    from nanochat.data.synthetic import SEPARATOR
    text = "ABC" + SEPARATOR + " ".join(["1ab", "2ac", "1ab", "1ba", "2ac", "2bc"])
    assert first_times(text) == [True, True, False, True, False, True]
