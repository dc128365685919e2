"""nanochat/data/synthetic.py's hops generator, checked by a solver written here from the document text alone."""

import pytest

from nanochat.data.synthetic import HopsSpec, hops_answers, hops_documents, iter_hops_documents

SPECS = [HopsSpec(), HopsSpec(n_symbols=2, max_hops=1, n_queries=1), HopsSpec(n_symbols=26, max_hops=9, n_queries=40)]


def parse(text):
    """(table as a dict, [(query symbol, digit, answer, index of the answer char)]) read by hand from the text."""
    table_text, query_text = text.split(" ; ")
    table = {}
    for pair in table_text.split(" "):
        key, arrow, value = pair
        assert arrow == ">" and key not in table
        table[key] = value
    queries, offset = [], len(table_text) + 3
    for query in query_text.split(" "):
        x, digit, equals, answer = query
        assert equals == "="
        queries.append((x, int(digit), answer, offset + 3))
        offset += len(query) + 1
    return table, queries


def lookups_to_reach(table, x, y, limit):
    """Every k in 1..limit with table applied k times to x giving y: the hop counts consistent with the answer."""
    found, current = [], x
    for k in range(1, limit + 1):
        current = table[current]
        if current == y:
            found.append(k)
    return found


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_answer_is_right_and_needs_its_recorded_hops(spec):
    seen_hops = set()
    for text in hops_documents(7, 200, spec):
        table, queries = parse(text)
        symbols = "abcdefghijklmnopqrstuvwxyz"[:spec.n_symbols]
        assert sorted(table) == list(symbols) and sorted(table.values()) == list(symbols)  # a permutation
        assert lookups_to_reach(table, "a", "a", spec.n_symbols) == [spec.n_symbols]  # one cycle through all
        assert len(queries) == spec.n_queries
        for x, digit, answer, _ in queries:
            assert 1 <= digit <= spec.max_hops
            # one cycle longer than max_hops: the digit is the only lookup count within max_hops reaching the answer
            assert lookups_to_reach(table, x, answer, spec.max_hops) == [digit], (text, x, digit, answer)
            assert answer != x
            seen_hops.add(digit)
        got = [(a.position, a.hops, a.answer) for a in hops_answers(text)]
        assert got == [(i, digit, answer) for _, digit, answer, i in queries]
        assert all(text[i] == answer for _, _, answer, i in queries)
    assert seen_hops == set(range(1, spec.max_hops + 1))


def test_a_wrong_answer_is_caught_by_the_solver():
    # the check above can fail: one answer changed to another symbol is no longer reachable in its digit's lookups
    text = hops_documents(0, 1)[0]
    table, queries = parse(text)
    x, digit, answer, i = queries[0]
    wrong = next(s for s in sorted(table) if s != answer)
    assert lookups_to_reach(table, x, wrong, 4) != [digit]


def test_deterministic_by_seed_and_spec():
    assert hops_documents(3, 50) == hops_documents(3, 50)
    assert hops_documents(3, 50) != hops_documents(4, 50)
    assert hops_documents(3, 50, HopsSpec(max_hops=3)) != hops_documents(3, 50)
    assert list(iter_hops_documents(3, 50)) == hops_documents(3, 50)  # the lazy generator draws the same documents
    assert hops_documents(3, 10) == hops_documents(3, 50)[:10]
    assert len(set(hops_documents(3, 50))) == 50


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_document_of_a_spec_has_the_same_length(spec):
    lengths = {len(text) for text in hops_documents(1, 300, spec)}
    assert lengths == {4 * spec.n_symbols - 1 + 3 + 5 * spec.n_queries - 1}


@pytest.mark.parametrize("fields, message", [({"n_symbols": 27}, "n_symbols=27: must be 2..26"),
                                             ({"max_hops": 0}, "max_hops=0: must be 1..9"),
                                             ({"n_symbols": 4, "max_hops": 4}, "max_hops=4: .* below n_symbols"),
                                             ({"n_queries": 0}, "n_queries=0: must be >= 1")])
def test_bad_spec_says_which_field(fields, message):
    with pytest.raises(ValueError, match=message):
        HopsSpec(**fields)


# ----------------------------------------------------------------------------- hops_pairs (issue 36's format in text)

def parse_pairs(text, n):
    """The pairs family read by hand: each table character decoded by trying every (key, value) of n symbols."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&()*+-/<>?@[]^_{|}~"
    code = {}
    for k in range(n):
        for v in (v for v in range(n) if v != k):
            code[alphabet[len(code)]] = (k, v)
    table_text, query_text = text.split(" ; ")
    table = dict(code[ch] for ch in table_text)
    assert len(table) == n == len(table_text)
    queries, offset = [], len(table_text) + 3
    for query in query_text.split(" "):
        digit, x, answer = query
        queries.append(("abcdefgh".index(x), int(digit), "abcdefgh".index(answer), offset + 2))
        offset += len(query) + 1
    return table, queries


def test_pairs_family_answers_right_and_shows_earlier_answers():
    from nanochat.data.synthetic import table_size
    spec, seen = HopsSpec(n_symbols=8, max_hops=4, n_queries=8), set()
    documents = hops_documents(3, 200, spec, family="hops_pairs")
    assert documents != hops_documents(3, 200, spec) and documents == hops_documents(3, 200, spec, "hops_pairs")
    for text in documents:
        table, queries = parse_pairs(text, 8)
        assert sorted(table.values()) == list(range(8)) and lookups_to_reach(table, 0, 0, 8) == [8]  # one cycle
        for x, digit, answer, _ in queries:
            assert lookups_to_reach(table, x, answer, spec.max_hops) == [digit]
            seen.add(digit)
        got = [(a.position, a.hops, "abcdefgh".index(a.answer)) for a in hops_answers(text)]
        assert got == [(i, digit, answer) for _, digit, answer, i in queries]
        assert table_size(text) == 8
    assert seen == {1, 2, 3, 4}
    assert table_size(hops_documents(0, 1, HopsSpec(n_symbols=6))[0]) == 6  # the "hops" family's table too
    assert hops_answers("no table here") == [] and hops_answers("AB ; nothing") == []
    with pytest.raises(ValueError, match="at most 8 symbols"):
        hops_documents(0, 1, HopsSpec(n_symbols=9), family="hops_pairs")
