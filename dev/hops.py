"""
The multi-hop lookup task trained in memory at CPU scale: accuracy by hops at every supervision step, for the
positive controls and the recursion ablations of issue 32 (dev/hops_grid.py runs them; dev/LOG.md has the tables).

python -m dev.hops --name plain1 --depth 1 --n_loops 0 --n_sup 1                                   # one plain block
python -m dev.hops --name loop --depth 1 --n_loops 0 --n_sup 4 --detach 0 --preset uniform         # it, looped 4x

--format masked (the default): one table as one token per entry, then queries whose answers are targets only (see
masked_row). --format chains: variable-binding rows, a depth task of another shape (chains_row). --format vchains:
issue 51's implicit depth, `a=b; b=c; c=3; ? a`, evaluated on chains longer than any in training (vchains_row).
--format answers: issue 36's pairs-and-answers rows (answers_row), whose answers stand in the input. --format pairs /
text: the LM documents of nanochat.data.synthetic (answers in the text, so later queries can reuse earlier answers).
The product's GPT, its forward_backward and optimizers (Muon + AdamW), warmup then linear warmdown. Prints one JSON
line per run (appended to --out): accuracy[step][hops] on held-out rows for steps 1..eval_mult x N, the answer loss
per step, and the training time.
"""

import argparse
import json
import random
import time

import torch

import nanochat.model.gpt
from nanochat.data.synthetic import HopsSpec, draw_table, hops_answers, hops_documents, pairs_answers, pairs_document
from nanochat.data.tokenizer import RustBPETokenizer
from nanochat.model.gpt import GPT, REFINEMENT_PRESETS, GPTConfig
from nanochat.train.depth import train_depth
from nanochat.train.optim import muon_momentum, setup_optimizers

FORMAT = {"name": "masked", "answers": hops_answers}  # main() sets it from --format


def masked_row(rng, spec):
    """(ids, answer positions, answer ids, hops) of one row: <|bos|>, the table as one token per entry k -> f(k), a
    separator, then queries (hops, x) whose answers are targets only, never inputs. Token ids, not text: n symbols
    need n(n-1) entry tokens (240 at n=16, more than the printable bytes). With answers in the text, a later query
    can reuse an earlier one's f^h(x) and skip lookups (a 2-layer model then 'answers' 4 hops at 8 symbols)."""
    n = spec.n_symbols
    f, order, queries = draw_table(rng, list(range(n)), spec)
    letter, digit = n * (n - 1), n * (n - 1) + n  # id bases: entries, then letters, then hop digits
    sep, bos = digit + spec.max_hops + 1, digit + spec.max_hops + 2
    ids = [bos] + [k * (n - 1) + f[k] - (f[k] > k) for k in order] + [sep]
    pos, answers, hops = [], [], []
    for x, h, y in queries:
        ids += [digit + h, letter + x]
        pos.append(len(ids) - 1)
        answers.append(letter + y)
        hops.append(h)
    return ids, pos, answers, hops


def masked_vocab(spec):
    return spec.n_symbols * (spec.n_symbols - 1) + spec.n_symbols + spec.max_hops + 3


CHAIN_DIGITS = 8  # the values a chain of variables can end in (--format chains)


def chain_queries(ids, pick, count, var, digit, value, depth):
    """Append count queries to a chains row's ids, each the variable pick() draws; returns their positions, answer
    ids (the digit its chain ends in) and depths."""
    pos, answers, hops = [], [], []
    for _ in range(count):
        x = pick()
        ids.append(var + x)
        pos.append(len(ids) - 1)
        answers.append(digit + value[x])
        hops.append(depth[x])
    return pos, answers, hops


def chains_row(rng, spec):
    """(ids, answer positions, answer ids, hops) of one variable-binding row, a depth task unlike the cycles: the
    spec.n_symbols variables form chains of spec.max_hops (v1 = digit, v2 = v1, v3 = v2, ...), each assignment one
    token, listed in random order after <|bos|>; then a separator and spec.n_queries queries, each a variable alone,
    whose answer (a target only, never an input) is the digit its chain ends in, reached in its depth's lookups."""
    n, length = spec.n_symbols, spec.max_hops
    assert n % length == 0, "n_symbols must be a multiple of max_hops: whole chains"
    names = list(range(n))
    rng.shuffle(names)
    bind, val, var, digit = 0, n * n, n * n + n * CHAIN_DIGITS, n * n + n * CHAIN_DIGITS + n
    statements, value, depth = [], {}, {}
    for c in range(n // length):
        chain, d = names[c * length:(c + 1) * length], rng.randrange(CHAIN_DIGITS)
        statements.append(val + chain[0] * CHAIN_DIGITS + d)
        statements += [bind + b * n + a for a, b in zip(chain, chain[1:])]  # b = a
        for h, v in enumerate(chain, start=1):
            value[v], depth[v] = d, h
    rng.shuffle(statements)
    ids = [digit + CHAIN_DIGITS + 1] + statements + [digit + CHAIN_DIGITS]  # <|bos|>, the assignments, separator
    return ids, *chain_queries(ids, lambda: rng.randrange(n), spec.n_queries, var, digit, value, depth)


VCHAIN_DIGITS = 10  # the values a chain can end in (--format vchains); a row's chains end in distinct ones


def vchains_ids(n):
    """The id bases of --format vchains at n variables: 'b = a' (n*n), 'v = d' (n*VCHAIN_DIGITS), a query naming v
    (n), the answer digit d, then the separator and <|bos|>."""
    bind, val = 0, n * n
    var = val + n * VCHAIN_DIGITS
    digit = var + n
    return bind, val, var, digit, digit + VCHAIN_DIGITS, digit + VCHAIN_DIGITS + 1


def vchains_vocab(spec):
    return vchains_ids(spec.n_symbols)[-1] + 1


def vchains_row(rng, spec, deep=None):
    """(ids, answer positions, answer ids, hops) of one implicit-depth row (issue 51), `a=b; b=c; c=3; ? a` with one
    token per assignment (as --format masked writes a table entry: one lookup is one attention): the spec.n_symbols
    variables form chains of random lengths 1..spec.max_hops (c = 3, b = c, a = b), the assignments in random order;
    then spec.n_queries queries, each a variable alone, answered (a target only) by its chain's digit, reached in as
    many lookups as the variable's depth, which nothing in the row states. The chains of a row end in distinct digits.
    deep=D: the first chain has D variables and every query names one of them (the evaluation past training: the
    same ids and row length, only a longer chain)."""
    n = spec.n_symbols
    assert not deep or deep <= n, "the deep chain must fit in the row's variables"
    assert n <= VCHAIN_DIGITS, "each chain ends in its own digit"
    names = list(range(n))
    rng.shuffle(names)
    lengths = [deep] if deep else []
    while sum(lengths) < n:
        lengths.append(min(rng.randint(1, spec.max_hops), n - sum(lengths)))
    bind, val, var, digit, sep, bos = vchains_ids(n)
    statements, value, depth, start = [], {}, {}, 0
    for length, d in zip(lengths, rng.sample(range(VCHAIN_DIGITS), len(lengths))):
        chain = names[start:start + length]
        start += length
        statements.append(val + chain[0] * VCHAIN_DIGITS + d)
        statements += [bind + b * n + a for a, b in zip(chain, chain[1:])]  # b = a
        for h, v in enumerate(chain, start=1):
            value[v], depth[v] = d, h
    rng.shuffle(statements)
    ids = [bos] + statements + [sep]
    asked = names[:deep] if deep else names
    return ids, *chain_queries(ids, lambda: rng.choice(asked), spec.n_queries, var, digit, value, depth)


def vchains_chance(rows, spec):
    """Accuracy by depth of guessing one of the row's chain digits at random: the floor a model reaches without
    walking a chain (1 / the row's number of chains, averaged over each depth's queries)."""
    n, total, count = spec.n_symbols, {}, {}
    _, val, var, *_ = vchains_ids(n)
    for ids, _, _, hops in rows:
        chains = sum(1 for t in ids[1:1 + n] if val <= t < var)  # the assignments of a digit
        for h in hops:
            total[h], count[h] = total.get(h, 0) + 1 / chains, count.get(h, 0) + 1
    return {h: total[h] / count[h] for h in sorted(total)}


def vchains_eval_rows(seed, count, spec, max_depth):
    """The implicit-depth evaluation: `count` rows for each longest chain 1..max_depth (past spec.max_hops: deeper
    than any training row), every query on that chain."""
    rng = random.Random(f"vchains-eval:{seed}")
    return [vchains_row(rng, spec, deep) for deep in range(1, max_depth + 1) for _ in range(count)]


def chains_vocab(spec):
    return spec.n_symbols * (spec.n_symbols + CHAIN_DIGITS + 1) + CHAIN_DIGITS + 2


BOS, SEP, EQ, SYMBOL, HOPS = 0, 1, 2, 3, 3 + 8  # the pairs-and-answers ids (issue 36); hop count k is HOPS + k - 1


def answers_row(rng, spec, hops=None, hide=False):
    """(ids, answer positions, answer ids, hops) of one pairs-and-answers row (issue 36, 8 symbols): BOS, the 8 pair
    tokens P[a][pi(a)] = 21 + 8a + pi(a) of one random 8-cycle pi in random order, then spec.n_queries queries
    SEP S[x] K[k] EQ S[pi^k(x)]. The answer is predicted at EQ and stands in the input of every later query, as in
    a language-model corpus; ids drop the last answer (input = the first 48 of 49 tokens). hops: fix every k.
    hide: a BLANK token stands where each answer would (the ablation: no answer is ever an input)."""
    assert spec.n_symbols == 8 and spec.max_hops <= 10, "the issue's vocabulary: 8 symbols, hop counts 1..10"
    cycle = list(range(8))
    rng.shuffle(cycle)
    pi = dict(zip(cycle, cycle[1:] + cycle[:1]))
    order = list(range(8))
    rng.shuffle(order)
    ids, pos, answers, ks = [BOS] + [HOPS + 10 + 8 * a + pi[a] for a in order], [], [], []
    for _ in range(spec.n_queries):
        x, k = rng.randrange(8), hops or rng.randint(1, spec.max_hops)
        y = x
        for _ in range(k):
            y = pi[y]
        ids += [SEP, SYMBOL + x, HOPS + k - 1, EQ]
        pos.append(len(ids) - 1)
        answers.append(SYMBOL + y)
        ks.append(k)
        ids.append(BLANK if hide else SYMBOL + y)
    return ids[:-1], pos, answers, ks


ANSWERS_VOCAB = HOPS + 10 + 64  # 85
BLANK = ANSWERS_VOCAB  # the 86th id, in --format answers_hidden only


def answers_eval_rows(seed, count, spec, hide=False):
    """The issue's evaluation: for each k in 1..max_hops, count rows whose queries all have k hops."""
    rng = random.Random(seed)
    return [answers_row(rng, spec, k, hide) for k in range(1, spec.max_hops + 1) for _ in range(count)]


# Ablations of the layer visit (gpt.visit_layer), swapped in by --variant: each changes one thing of it.
VISIT = nanochat.model.gpt.visit_layer  # the original, kept: --variant replaces the module's name


def visit_xyz_both(block, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0):
    """the answer update reads x + y + z too (no y + z split)"""
    for i in range(n_loops + 1):
        u = x + y + z
        delta = block.delta(u, cos_sin, kv_cache, slot + i)
        if i < n_loops:
            z = update(z, u, delta, None)
        else:
            y = update(y, u, delta, None)
    return y, z


def visit_no_x(block, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0):
    """the latent updates read y + z: x enters only as y's start (no re-injection)"""
    return VISIT(block, torch.zeros_like(x), y, z, cos_sin, n_loops, update, kv_cache, slot)


def visit_z_postnorm(block, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0):
    """the latent keeps itself: z <- norm(z + D(x + y + z)), x and y read but not re-added into z (issue 36)"""
    for i in range(n_loops):
        u = x + y + z
        z = nanochat.model.gpt.norm(z + block.delta(u, cos_sin, kv_cache, slot + i))
    u = y + z
    return update(y, u, block.delta(u, cos_sin, kv_cache, slot + n_loops), None), z


def visit_half_step(block, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0):
    """a contraction of TRM's update (issue 51): each state moves halfway to it, s <- norm(s + update(s, u, D)), so a
    step changes a settled state less and the walk cannot drift as fast past the trained steps"""
    half = lambda state, u, delta, retain: nanochat.model.gpt.norm(state + update(state, u, delta, retain))
    return VISIT(block, x, y, z, cos_sin, n_loops, half, kv_cache, slot)


VARIANTS = {"default": VISIT, "xyz_both": visit_xyz_both, "no_x": visit_no_x, "z_postnorm": visit_z_postnorm,
            "half_step": visit_half_step}


def documents(seed, count, spec):
    if FORMAT["name"] == "text":
        return hops_documents(seed, count, spec)
    rng = random.Random(f"{FORMAT['name']}:{seed}")
    if FORMAT["name"] == "answers_hidden":
        return [answers_row(rng, spec, hide=True) for _ in range(count)]
    row = {"masked": masked_row, "chains": chains_row, "vchains": vchains_row, "answers": answers_row,
           "pairs": pairs_document}[FORMAT["name"]]
    return [row(rng, spec) for _ in range(count)]


def batches(docs, tokenizer):
    """(idx, targets, answer index per row, hops per row) of byte-level documents, each starting with <|bos|>."""
    if FORMAT["name"] in ("masked", "chains", "vchains", "answers", "answers_hidden"):  # token-id rows
        ids, pos, answers, hops = (torch.tensor(column) for column in zip(*docs))
        return ids, torch.full_like(ids, -1).scatter_(1, pos, answers), pos, hops
    rows = [tokenizer.encode(d, prepend=tokenizer.get_bos_token_id()) for d in docs]
    ids = torch.tensor(rows)
    answers = [FORMAT["answers"](d) for d in docs]
    pos = torch.tensor([[a.position for a in ans] for ans in answers])  # char p is token p+1, predicted at p
    hops = torch.tensor([[a.hops for a in ans] for ans in answers])
    return ids[:, :-1], ids[:, 1:], pos, hops


@torch.no_grad()
def evaluate(model, data, n_steps, max_hops, batch=64):
    device = model.lm_head.weight.device
    idx, targets, pos, hops = (t.to(device) for t in data)
    correct = torch.zeros(n_steps, max_hops + 1, device=device)
    count = torch.zeros(max_hops + 1, device=device)
    answer_loss = torch.zeros(n_steps, device=device)
    for i in range(0, idx.size(0), batch):
        x, t, p, h = idx[i:i + batch], targets[i:i + batch], pos[i:i + batch], hops[i:i + batch]
        count += torch.bincount(h.flatten(), minlength=max_hops + 1)
        for s, (y, _) in enumerate(model.refine(x, n_steps)):
            logits = model.head(model.apply_coda(y)).gather(1, p[..., None].expand(-1, -1, model.config.vocab_size))
            want = t.gather(1, p)
            right = (logits.argmax(-1) == want).float()
            correct[s] += torch.zeros_like(count).index_add_(0, h.flatten(), right.flatten())
            answer_loss[s] += torch.nn.functional.cross_entropy(logits.flatten(0, 1), want.flatten(), reduction="sum")
    return (correct / count.clamp(min=1))[:, 1:].cpu(), (answer_loss / count.sum()).cpu()


def packed_rows(seed, spec, tokenizer, batch, T):
    """(idx, targets) of base_train's loader (nanochat/data/dataloader.py) on the same documents: each document's tokens
    with <|bos|> first, concatenated into one stream and cut into rows of T+1 tokens, so a row may hold the end of
    one document, whole ones and the start of another (its table cut off from its queries, or its queries in
    another row). Attention runs across the documents of a row, as in base_train."""
    stream, k, need = [], 0, batch * (T + 1)
    while True:
        while len(stream) < need:
            stream += [t for d in documents(f"{seed}:pack:{k}", 64, spec)
                       for t in tokenizer.encode(d, prepend=tokenizer.get_bos_token_id())]
            k += 1
        rows, stream = torch.tensor(stream[:need]).view(batch, T + 1), stream[need:]
        yield rows[:, :-1], rows[:, 1:]


def documents_per_row(idx, targets, k):
    """One-document rows (idx, targets) regrouped k whole documents to a row: the same tokens, each document still
    <|bos|>-led, the last token of one predicting the next's <|bos|> (as in base_train's rows)."""
    if k == 1:
        return idx, targets
    rows = torch.cat([idx, targets[:, -1:]], 1).reshape(idx.size(0) // k, -1)
    return rows[:, :-1], rows[:, 1:]


def offset_rows(idx, targets, offset, filler):
    """Each one-document row after `offset` filler tokens (unscored): the document as far into its row as the last of
    K documents to a row, with nothing before it that looks like a table (the control for --docs_per_row)."""
    pad = torch.full((idx.size(0), offset), filler, dtype=idx.dtype)
    return torch.cat([pad, idx], 1), torch.cat([torch.full_like(pad, -1), targets], 1)


def train(model, optimizers, spec, tokenizer, steps, batch, seed, warmup=100, warmdown=0.3, answers_only=False,
          report=None, clip=0.0, pack=0, momentum_warmup=False, docs_per_row=1, row_offset=0, depth_warmup=0.0):
    """`steps` optimizer steps on fresh documents (seeded by seed and step), warmup then linear warmdown.
    pack=T: rows of T tokens cut from the document stream as base_train's loader does (packed_rows).
    docs_per_row=K: the same step's documents, K whole ones back to back in a row (batch/K rows), as --rows=documents
    and the depth probe fill a long row; attention runs across them. row_offset=N: N unscored <|bos|> before each
    one-document row instead (offset_rows).
    momentum_warmup: Muon's momentum from 0.85 to 0.95 over 300 steps (base_train's muon_momentum); else 0.95.
    depth_warmup: the step-count curriculum's fraction, as base_train's --n_sup_warmup (train/depth.py's cap on the
    model's draw)."""
    assert not (pack and answers_only), "--answers_only needs one document per row"
    assert docs_per_row == 1 or (FORMAT["name"] in ("pairs", "text") and not pack and not answers_only
                                 and batch % docs_per_row == 0), "--docs_per_row: byte-level documents, batch % K == 0"
    packed = packed_rows(seed, spec, tokenizer, batch, pack) if pack else None
    for step in range(steps):
        lrm = min(1.0, (step + 1) / warmup) * min(1.0, (1 - step / steps) / warmdown)
        for opt in optimizers:
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * lrm
                if momentum_warmup and "momentum" in g:
                    g["momentum"] = muon_momentum(step)
        if packed:
            idx, targets = (t.to(model.lm_head.weight.device) for t in next(packed))
            pos = None
        else:
            idx, targets, pos, _ = (t.to(model.lm_head.weight.device)
                                    for t in batches(documents(f"{seed}:{step}", batch, spec), tokenizer))
            idx, targets = documents_per_row(idx, targets, docs_per_row)
            if row_offset:
                idx, targets = offset_rows(idx, targets, row_offset, tokenizer.get_bos_token_id())
        if answers_only:
            targets = torch.full_like(targets, -1).scatter_(1, pos, targets.gather(1, pos))
        _, aux = model.forward_backward(idx, targets, n_sup=train_depth(model.config, step, depth_warmup, steps))
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        if report:
            report(step, aux)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--n_head", type=int, default=2)
    ap.add_argument("--n_loops", type=int, default=2)
    ap.add_argument("--n_sup", type=int, default=4)
    ap.add_argument("--T_recursion", type=int, default=1)
    ap.add_argument("--state_update", default="trm")
    ap.add_argument("--detach", type=int, default=1)
    ap.add_argument("--backprop_steps", type=int, default=GPTConfig.backprop_steps,
                    help="with --detach 1: detach after every k-th step (default: gpt.py's)")
    ap.add_argument("--preset", default="aggressive", choices=REFINEMENT_PRESETS)
    ap.add_argument("--matrix_lr", type=float, default=0.02)
    ap.add_argument("--embedding_lr", type=float, default=0.2)
    ap.add_argument("--unembedding_lr", type=float, default=0.004)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--warmdown", type=float, default=0.3)
    ap.add_argument("--max_hops", type=int, default=4)
    ap.add_argument("--n_symbols", type=int, default=12)
    ap.add_argument("--n_queries", type=int, default=16)
    ap.add_argument("--eval_docs", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cuda: float32 on the GPU (the rows stay drawn on the CPU)")
    ap.add_argument("--extra", default="{}", help="JSON of further GPTConfig fields")
    ap.add_argument("--answers_only", type=int, default=0, help="1: the loss reads only the answer tokens")
    ap.add_argument("--eval_every", type=int, default=0)
    ap.add_argument("--adamw", type=float, default=0.0, help="one AdamW at this lr instead of Muon + AdamW")
    ap.add_argument("--format", default="masked", choices=["masked", "chains", "vchains", "answers", "answers_hidden",
                                                           "pairs", "text"])
    ap.add_argument("--eval_depth", type=int, default=0, help="vchains: evaluate chains 1..this long (default "
                    "2 x --max_hops: deeper than any training row)")
    ap.add_argument("--eval_mult", type=int, default=2, help="evaluate supervision steps 1 .. this x --n_sup")
    ap.add_argument("--depth_warmup", type=float, default=0.0, help="the step-count curriculum, as base_train's "
                    "--n_sup_warmup: at most 1 supervision step at first, the cap rising by --n_sup per fraction")
    ap.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: no clipping)")
    ap.add_argument("--pack", type=int, default=0, help="rows of this many tokens cut from the document stream, as "
                    "base_train's loader packs them (0: one document per row)")
    ap.add_argument("--docs_per_row", type=int, default=1, help="K whole documents back to back in a row (batch/K "
                    "rows of the same documents), as --rows=documents and the depth probe fill long rows")
    ap.add_argument("--row_offset", type=int, default=0, help="N unscored <|bos|> before each one-document row: "
                    "the control for --docs_per_row (as far into the row, nothing table-like before it)")
    ap.add_argument("--momentum_warmup", type=int, default=0, help="1: Muon momentum 0.85 -> 0.95 over 300 steps, "
                    "as base_train (0: 0.95 throughout)")
    ap.add_argument("--log_every", type=int, default=250, help="steps between the printed per-step losses")
    ap.add_argument("--out", default=None)
    ap.add_argument("--variant", default="default", choices=VARIANTS, help="the layer visit (an ablation)")
    ap.add_argument("--save", default=None, help="torch.save {config, state_dict} of the trained model here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    nanochat.model.gpt.visit_layer = VARIANTS[args.variant]  # Block.visit looks it up at call time

    tok = RustBPETokenizer.byte_level()
    spec = HopsSpec(n_symbols=args.n_symbols, max_hops=args.max_hops, n_queries=args.n_queries)
    FORMAT.update(name=args.format, answers=pairs_answers if args.format == "pairs" else hops_answers)
    length = batches(documents(0, 1, spec), tok)[0].size(1)
    vocab = {"masked": masked_vocab(spec), "chains": chains_vocab(spec), "vchains": vchains_vocab(spec),
             "answers": ANSWERS_VOCAB, "answers_hidden": ANSWERS_VOCAB + 1}.get(
        args.format, tok.get_vocab_size())
    config = GPTConfig.with_refinement_preset(
        args.preset, sequence_len=max(length, args.pack, args.docs_per_row * (length + 1) - 1) + args.row_offset,
        vocab_size=vocab, n_layer=args.depth, n_head=args.n_head,
        n_kv_head=args.n_head, n_embd=args.width, n_loops=args.n_loops, n_sup_train=args.n_sup,
        T_recursion=args.T_recursion, state_update=args.state_update, detach_between_steps=bool(args.detach),
        backprop_steps=args.backprop_steps,
        **json.loads(args.extra))
    model = GPT(config)
    model.init_weights()  # on the CPU: the same initial weights on every device
    model.to(args.device)
    if args.adamw:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=args.adamw, betas=(0.9, 0.98), weight_decay=0.0)]
        optimizers[0].param_groups[0]["initial_lr"] = args.adamw
    else:
        optimizers = setup_optimizers(model, unembedding_lr=args.unembedding_lr, embedding_lr=args.embedding_lr,
                                      matrix_lr=args.matrix_lr)
    eval_hops = (args.eval_depth or 2 * args.max_hops) if args.format == "vchains" else args.max_hops
    chance = None
    if args.format == "vchains":
        rows = vchains_eval_rows(10_000 + args.seed, args.eval_docs // eval_hops, spec, eval_hops)
        val, chance = batches(rows, tok), vchains_chance(rows, spec)
        print(f"{args.name}: chance by depth {[round(c, 2) for c in chance.values()]} (a digit of the row's chains)")
    elif args.format.startswith("answers"):
        val = batches(answers_eval_rows(10_000 + args.seed, args.eval_docs // args.max_hops, spec,
                                        args.format == "answers_hidden"), tok)
    else:
        val = batches(documents(10_000 + args.seed, args.eval_docs, spec), tok)
    start, log = time.time(), []

    def report(step, aux):
        if args.eval_every and step % args.eval_every == 0:
            acc, _ = evaluate(model, val, args.n_sup, eval_hops)
            print(f"{args.name} step {step} acc at step {args.n_sup} by hops {[round(v, 2) for v in acc[-1].tolist()]}",
                  flush=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            log.append((step, [round(v, 3) for v in aux["step_losses"].tolist()]))
            print(f"{args.name} step {step} losses {log[-1][1]} {time.time() - start:.0f}s", flush=True)

    train(model, optimizers, spec, tok, args.steps, args.batch, args.seed, args.warmup, args.warmdown,
          bool(args.answers_only), report, args.clip, args.pack, bool(args.momentum_warmup), args.docs_per_row,
          args.row_offset, args.depth_warmup)
    train_s = time.time() - start
    acc, answer_loss = evaluate(model, val, args.eval_mult * args.n_sup, eval_hops)
    result = {"name": args.name, "seed": args.seed, "args": vars(args), "params": model.num_params(),
              "train_s": round(train_s), "acc": [[round(v, 3) for v in row] for row in acc.tolist()],
              "answer_loss": [round(v, 3) for v in answer_loss.tolist()], "log": log,
              "chance": chance and [round(c, 3) for c in chance.values()]}
    trained = acc[args.n_sup - 1].tolist()
    print(f"RESULT {args.name} seed {args.seed} at step {args.n_sup}: by hops {[round(v, 2) for v in trained]}; "
          f"{eval_hops} hops by step {[round(v, 2) for v in acc[:, -1].tolist()]}", flush=True)
    if args.save:
        torch.save({"config": config.to_dict(), "state_dict": model.state_dict()}, args.save)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
