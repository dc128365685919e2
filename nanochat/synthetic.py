"""
Generated reasoning corpora: text documents whose answers need a known number of composed steps, so that depth (and a
recursion that adds depth) can be measured offline.

"hops": a random cyclic permutation f of n symbols (one cycle through all of them, so f^h(x) != x for h < n and no
answer can be guessed from the query's own symbol), listed as "a>k" pairs in a random order, then queries "x3=y"
with y = f(f(f(x))): the digit is the number of hops (chained lookups in the table) the answer needs. Every document holds
many answers, each recording its hop count, and every document of one spec has the same length in characters.

    a>k c>a k>c ... ; a2=c k1=c c3=c ...

A lookup is one attention from the query to the key's place in the table, after one more (any layer earlier) that
copies each value onto its key: a model answers h hops with about h + 1 attention layers (Saunshi et al.'s p-hop).
"""

import random
import string
from dataclasses import dataclass

SYNTHETIC_FAMILIES = ("hops",)
SEPARATOR = " ; "  # between the table and the queries


@dataclass(frozen=True)
class HopsSpec:
    n_symbols: int = 16
    max_hops: int = 4
    n_queries: int = 24

    def __post_init__(self):
        if not 2 <= self.n_symbols <= 26:
            raise ValueError(f"n_symbols={self.n_symbols}: must be 2..26 (one lowercase letter each)")
        if not 1 <= self.max_hops <= min(9, self.n_symbols - 1):
            raise ValueError(f"max_hops={self.max_hops}: must be 1..9 (one digit in the query) and below n_symbols "
                             f"(the cycle would come back to the query's symbol)")
        if self.n_queries < 1:
            raise ValueError(f"n_queries={self.n_queries}: must be >= 1")


@dataclass(frozen=True)
class Answer:
    """One query of a document: the answer character sits at text[position] and needs `hops` lookups."""
    position: int
    hops: int
    answer: str


def draw_table(rng, symbols, spec):
    """(f, order, queries): a random cycle f through symbols, the table's listing order, and spec.n_queries queries
    (x, hops, f^hops(x))."""
    cycle = symbols[:]
    rng.shuffle(cycle)
    f = {a: b for a, b in zip(cycle, cycle[1:] + cycle[:1])}
    order = symbols[:]
    rng.shuffle(order)
    queries = []
    for _ in range(spec.n_queries):
        x, hops = rng.choice(symbols), rng.randint(1, spec.max_hops)
        y = x
        for _ in range(hops):
            y = f[y]
        queries.append((x, hops, y))
    return f, order, queries


def hops_document(rng, spec):
    """One document (no trailing newline) drawn with random.Random rng."""
    f, order, queries = draw_table(rng, list(string.ascii_lowercase[:spec.n_symbols]), spec)
    return " ".join(f"{k}>{f[k]}" for k in order) + SEPARATOR + " ".join(f"{x}{h}={y}" for x, h, y in queries)


PAIR_ALPHABET = string.ascii_uppercase + string.digits + "!#$%&()*+-/<>?@[]^_{|}~"  # 59 characters


def pair_char(k, v, n):
    """Table entry k -> v (v != k, as f is one cycle) of n symbols as one character: n * (n - 1) <= 59 for n <= 8."""
    return PAIR_ALPHABET[k * (n - 1) + v - (v > k)]


def pairs_document(rng, spec):
    """The same task with each table entry k -> v written as ONE character (pair_char), and each query as " 3ac":
    hops, x, then the answer, predicted at x's own position. One lookup is then one attention layer."""
    n, letters = spec.n_symbols, string.ascii_lowercase
    f, order, queries = draw_table(rng, list(range(n)), spec)
    return ("".join(pair_char(k, f[k], n) for k in order) + SEPARATOR +
            " ".join(f"{h}{letters[x]}{letters[y]}" for x, h, y in queries))


def pairs_answers(text):
    body = text.split(SEPARATOR, 1)
    start = len(body[0]) + len(SEPARATOR)
    return [Answer(start + i + 2, int(text[start + i]), text[start + i + 2]) for i in range(0, len(body[1]), 4)]


def iter_hops_documents(seed, count, spec=HopsSpec()):
    """hops_documents one at a time: a corpus of millions of documents never sits in memory as a list."""
    rng = random.Random(f"hops:{seed}:{spec.n_symbols}:{spec.max_hops}:{spec.n_queries}")
    for _ in range(count):
        yield hops_document(rng, spec)


def hops_documents(seed, count, spec=HopsSpec()):
    """`count` documents, deterministic in (seed, spec)."""
    return list(iter_hops_documents(seed, count, spec))


def hops_answers(text):
    """The answers of a hops document, read from its text: every "=" is followed by one answer character, and the
    digit before it is the hop count."""
    return [Answer(i + 1, int(text[i - 1]), text[i + 1]) for i, ch in enumerate(text) if ch == "="]
