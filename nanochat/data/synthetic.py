"""
Generated reasoning corpora: text documents whose answers need a known number of composed steps, so that depth (and a
recursion that adds depth) can be measured offline.

"hops": a random cyclic permutation f of n symbols (one cycle through all of them, so f^h(x) != x for h < n and no
answer can be guessed from the query's own symbol), listed as "a>k" pairs in a random order, then queries "x3=y"
with y = f(f(f(x))): the digit is the number of hops (chained lookups in the table) the answer needs. Every document
holds many answers, each recording its hop count, and every document of one spec has the same length in characters.

    a>k c>a k>c ... ; a2=c k1=c c3=c ...

A lookup is one attention from the query to the key's place in the table, after one more (any layer earlier) that
copies each value onto its key: a model answers h hops with about h + 1 attention layers (Saunshi et al.'s p-hop).
"""

import random
import re
import string
from dataclasses import dataclass

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
    hops, x, then the answer, predicted at x's own position. One lookup is then one attention layer; as in "hops",
    earlier answers stand in the text (issue 36's pairs-and-answers format, in characters)."""
    n, letters = spec.n_symbols, string.ascii_lowercase
    if n * (n - 1) > len(PAIR_ALPHABET):
        raise ValueError(f"n_symbols={n}: the pairs format writes each table entry as one character, which allows "
                         f"at most 8 symbols")
    f, order, queries = draw_table(rng, list(range(n)), spec)
    return ("".join(pair_char(k, f[k], n) for k in order) + SEPARATOR +
            " ".join(f"{h}{letters[x]}{letters[y]}" for x, h, y in queries))


PAIRS_QUERY = re.compile(r"([0-9])[a-z]([a-z])")  # " 3ac": hops, x, the answer (\d would take any script's digits)


def pairs_answers(text):
    """The answers of a pairs document; none when the text is not one."""
    if SEPARATOR not in text:
        return []
    start = text.index(SEPARATOR) + len(SEPARATOR)
    return [Answer(m.start(2), int(m.group(1)), m.group(2)) for m in PAIRS_QUERY.finditer(text, start)]


# family -> how one document is drawn; "hops_pairs" is the pairs-and-answers format: one character per table entry
FAMILIES = {"hops": hops_document, "hops_pairs": pairs_document}
SYNTHETIC_FAMILIES = tuple(FAMILIES)


def iter_hops_documents(seed, count, spec=HopsSpec(), family="hops"):
    """hops_documents one at a time: a corpus of millions of documents never sits in memory as a list."""
    prefix = "hops" if family == "hops" else family  # "hops" keeps the seeds of the corpora built before families
    rng = random.Random(f"{prefix}:{seed}:{spec.n_symbols}:{spec.max_hops}:{spec.n_queries}")
    for _ in range(count):
        yield FAMILIES[family](rng, spec)


def curriculum_documents(seed, count, spec=HopsSpec(), family="hops"):
    """`count` documents whose queries need at most 1 hop, then at most 2, ... up to spec.max_hops - 1, in that order
    (count / (max_hops - 1) at each level): a corpus's first training documents under --hops_curriculum, so that a
    model learns one lookup before it must compose them."""
    levels = spec.max_hops - 1
    for level in range(levels):
        part = count * (level + 1) // levels - count * level // levels
        yield from iter_hops_documents(f"curriculum:{seed}:{level + 1}", part,
                                       HopsSpec(spec.n_symbols, level + 1, spec.n_queries), family)


def hops_documents(seed, count, spec=HopsSpec(), family="hops"):
    """`count` documents, deterministic in (seed, spec, family)."""
    return list(iter_hops_documents(seed, count, spec, family))


def hops_answers(text):
    """The answers of a document of either family, read from its text. "hops": every "=" is followed by one answer
    character, and the digit before it is the hop count. "hops_pairs" (no "=" anywhere): pairs_answers. A ValueError
    says where a "hops" query is malformed (a pasted document)."""
    if "=" not in text:
        return pairs_answers(text)
    answers = []
    for i, ch in enumerate(text):
        if ch != "=":
            continue
        if i == 0 or text[i - 1] not in string.digits:  # not str.isdigit: it takes any script's digits, and ²
            raise ValueError(f"the '=' at character {i + 1} ({text[max(0, i - 2):i + 2]!r}) must follow a hop count "
                             f"digit 0-9, as in 'a3=b' (a query: symbol, hops, '=', answer)")
        if i + 1 == len(text):
            raise ValueError("the text ends with '=': write each query's answer after it, as in 'a3=b'")
        answers.append(Answer(i + 1, int(text[i - 1]), text[i + 1]))
    return answers


def table_size(text):
    """How many symbols a document's table lists (one entry each): chance accuracy is one over it."""
    table = text.split(SEPARATOR)[0]
    return len(table.split()) if " " in table else len(table)


class HopsEvalError(ValueError):
    """The documents or the tokenizer cannot be evaluated: the message says why and what to do."""


def encode_hops(tokenizer, text, answer_ids=None):
    """(ids, answers): <|bos|> then the text, encoded in pieces split around each answer character so each answer is
    one token of its own (a BPE merge across it would hide it); answers are (index in ids, hops, token id, bytes).
    answer_ids: a cache of answer character -> token id, shared across documents."""
    answers = hops_answers(text)
    if not answers:
        raise HopsEvalError(f"a document holds no hops query ('x3=y' or ' 3xy'): {text[:60]!r}...; evaluate a "
                            "corpus made by python -m nanochat.dataset --synthetic=hops (or =hops_pairs)")
    answer_ids = {} if answer_ids is None else answer_ids
    ids, out, start = [tokenizer.get_bos_token_id()], [], 0
    for a in answers:
        ids += tokenizer.encode(text[start:a.position]) if a.position > start else []
        if a.answer not in answer_ids:
            pieces = tokenizer.encode(a.answer)
            if len(pieces) != 1:
                raise HopsEvalError(f"the answer character {a.answer!r} is {len(pieces)} tokens under this tokenizer, "
                                    "not one; train a byte-level tokenizer (python -m scripts.tok_train --byte_level)")
            answer_ids[a.answer] = pieces[0]
        out.append((len(ids), a.hops, answer_ids[a.answer], len(a.answer.encode())))
        ids.append(answer_ids[a.answer])
        start = a.position + 1
    ids += tokenizer.encode(text[start:]) if start < len(text) else []
    return ids, out
