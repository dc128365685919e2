"""
Inference for the TRM GPT: a KV cache with one slot per virtual layer, and an Engine that samples from it.

A forward of the recursion applies attention n_sup * T_recursion * n_layer * (n_loops+1) times, and each of those
applications (a "virtual layer": supervision step, sweep, layer, loop) sees its own inputs, so it has its own keys
and values. The cache keeps one slot for each: sharing a slot per physical layer would make a decoded token attend
to keys the full forward never computed.

Rows of different lengths are left-padded to a common length and the padding is masked out of every attention.
The model rotates q and k at absolute positions, and rotary attention depends only on the distance between
positions, so a row shifted right by its padding computes the same logits (to float rounding) as the row alone.

A server's requests come and go: a Batch decodes them over a RowCache, in which each row sits at a position of its
own, so a request joins at any token (its prompt prefilled apart, then copied in) and leaves when done. A request of
fewer supervision steps rides a deeper batch too: its rows take the answer of their own last step (forward_at_depths).
"""

import contextlib
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .halting import Halting, check_halting, forward_halting

# A reply is text, so every special token ends it: <|bos|> starts the next document (a base model 'ends' by emitting
# it), <|assistant_end|> ends a chat model's turn, and any other opens or closes a turn or span that is not the
# reply's (the user's, a new assistant turn, a tool's call or output: this server runs no tool), which run on would be
# written as the assistant's. nanochat/data/tokenizer.py's SPECIAL_TOKENS, <|bos|> first (the export's bos and pad)
STOP_TOKENS = ("<|bos|>", "<|assistant_end|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>",
               "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


def compute_dtype(model):
    """The dtype activations, and so the cached keys and values, take: autocast's when it is on, else the weights'."""
    device_type = model.lm_head.weight.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return model.lm_head.weight.dtype


def kv_cache_bytes_per_token(model, n_sup, dtype=None):
    """Cache memory per token of one row: keys and values for every attention application of the recursion."""
    c = model.config
    element_size = (dtype or compute_dtype(model)).itemsize
    return 2 * model.num_attention_slots(n_sup) * c.n_kv_head * (c.n_embd // c.n_head) * element_size


class KVCache:
    """Keys and values of every slot for a batch of rows, each row left-padded by pads[b] tokens."""

    def __init__(self, num_slots, batch_size, max_len, pads=None):
        self.num_slots, self.batch_size, self.max_len = num_slots, batch_size, max_len
        self.pads = pads  # (B,) long tensor of left-padding per row, or None when no row is padded
        self.k = [None] * num_slots  # allocated on first use, in the dtype and device the model computes in
        self.v = [None] * num_slots
        self.pos = 0  # tokens already cached (padding included); the model rotates new tokens from here
        self._mask = None  # one attention mask serves every slot of a forward
        self.halted = None  # (B, T) bool: this forward's positions that halted (halting.forward_halting); see hold
        self.slots_per_step = None

    def attend(self, slot, q, k, v):
        """Append this forward's k, v to the slot and attend q causally over everything the slot holds."""
        T = q.size(2)
        keys, values = self.store(slot, k, v)
        gqa = q.size(1) != k.size(1)
        if self.pads is None and self.pos == 0:
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        if self.pads is None and T == 1:
            return F.scaled_dot_product_attention(q, keys, values, enable_gqa=gqa)  # a new last token sees all
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask(T, q.device), enable_gqa=gqa)

    def store(self, slot, k, v):
        """The slot's keys and values so far, this forward's appended (into buffers allocated once, at max_len)."""
        end = self.pos + k.size(2)
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; this forward would need {end}")
        self.allocate(slot, k, v)
        if self.halted is not None:  # a halted position's keys and values stay those of the step it halted at
            held, earlier = self.halted[:, None, :, None], slot - self.slots_per_step
            k = torch.where(held, self.k[earlier][:, :, self.pos:end], k)
            v = torch.where(held, self.v[earlier][:, :, self.pos:end], v)
        self.k[slot][:, :, self.pos:end] = k
        self.v[slot][:, :, self.pos:end] = v
        return self.k[slot][:, :, :end], self.v[slot][:, :, :end]

    def allocate(self, slot, k, v):
        if self.k[slot] is None:
            shape = (self.batch_size, k.size(1), self.max_len, k.size(3))
            # both in v's dtype, the compute dtype (a float32 key would double the keys' memory and reads)
            self.k[slot], self.v[slot] = v.new_empty(shape), v.new_empty(shape)

    def hold(self, halted, slots_per_step):
        """From the next supervision step of this forward on, positions where halted (B, T) is True store the keys
        and values they stored slots_per_step slots earlier, i.e. those of the step they halted at."""
        self.halted, self.slots_per_step = halted, slots_per_step

    def repeat_step(self, start, stop, slots_per_step, T):
        """Fill slots start..stop-1 for this forward's T positions with the keys and values of the slot one step
        earlier: the steps that every position of the forward skipped."""
        now = slice(self.pos, self.pos + T)
        for slot in range(start, stop):
            source = slot - slots_per_step
            self.allocate(slot, self.k[source], self.v[source])
            self.k[slot][:, :, now] = self.k[source][:, :, now]
            self.v[slot][:, :, now] = self.v[source][:, :, now]

    def mask(self, T, device):
        """(B, 1, T, pos+T) bool: causal, padding hidden; a padding query sees itself so its softmax is defined."""
        if self._mask is None:
            q_pos = torch.arange(self.pos, self.pos + T, device=device)[:, None]
            k_pos = torch.arange(self.pos + T, device=device)[None, :]
            mask = (k_pos <= q_pos)[None, None]
            if self.pads is not None:
                not_pad = k_pos[None, None] >= self.pads.to(device)[:, None, None, None]
                mask = mask & (not_pad | (k_pos == q_pos)[None, None])
            self._mask = mask
        return self._mask

    def advance(self, T):
        self.pos += T
        self._mask = None
        self.halted = None


class RowCache(KVCache):
    """Keys and values of rows that each sit at a position of their own, so that a row joins (its prompt prefilled in
    a KVCache of its own, then copied in) and leaves at any token. Row b holds lens[b] columns, the first row_pads[b]
    of them padding; a forward feeds every row one token, written at its own column and rotated at that position, so
    a row computes what it computes in the KVCache it was prefilled in."""

    def __init__(self, num_slots):
        super().__init__(num_slots, batch_size=0, max_len=0)
        self.lens, self.row_pads = [], []  # per row, on the host: columns held, of them padding
        self.cols = self.starts = None  # the same on the device, for the forward
        self.active = None  # the rows a forward computes, when not all (narrow)

    @property
    def rows(self):
        return len(self.lens)

    @property
    def pos(self):  # the model rotates each row's new token at its own column
        return self.cols

    @pos.setter
    def pos(self, value):  # KVCache.__init__ sets 0; rows carry their own positions instead
        pass

    def reserve(self, rows, length, like):
        """Room for rows x length columns in every slot, buffers grown (and copied) as needed; like: a tensor in the
        dtype and device keys take, its shape (B, H, T, D)."""
        if rows <= self.batch_size and length <= self.max_len:
            return
        # grown by half again at least, so a stream of joiners reallocates O(log) times
        rows, length = max(rows, self.batch_size * 3 // 2), max(length, self.max_len * 3 // 2)
        for cache in (self.k, self.v):
            for slot, old in enumerate(cache):
                # zeros, not empty: a masked column's value still enters softmax(.) @ v, and 0 * NaN is NaN
                new = like.new_zeros((rows, like.size(1), length, like.size(3)))
                if old is not None:
                    new[:old.size(0), :, :old.size(2)] = old
                cache[slot] = new
        self.batch_size, self.max_len = rows, length

    def join(self, cache, length):
        """Append the rows of a KVCache prefilled to cache.pos columns; length: columns they will reach."""
        B, first = cache.batch_size, self.rows
        self.reserve(first + B, length, cache.k[0])
        for mine, theirs in ((self.k, cache.k), (self.v, cache.v)):
            for slot, source in enumerate(theirs):
                if source is not None:
                    mine[slot][first:first + B, :, :cache.pos] = source[:, :, :cache.pos]
        self.lens += [cache.pos] * B
        self.row_pads += cache.pads.tolist() if cache.pads is not None else [0] * B
        self.synced()

    def free(self, rows):
        """Remove these rows; the last rows kept move into the places freed below the new count (one copy each, the
        other rows stay). Returns the old index of each row kept, in its new order."""
        gone, count = set(rows), self.rows - len(set(rows))
        order = list(range(count))
        holes = [r for r in range(count) if r in gone]
        tails = [r for r in range(count, self.rows) if r not in gone]
        for hole, tail in zip(holes, tails):
            order[hole] = tail
        if holes:
            device = self.k[0].device
            to, source = torch.tensor(holes, device=device), torch.tensor(tails, device=device)
            for cache in (self.k, self.v):
                for tensor in cache:
                    tensor[to] = tensor[source]
        self.lens = [self.lens[r] for r in order]
        self.row_pads = [self.row_pads[r] for r in order]
        self.synced()
        return order

    def synced(self):
        device = self.k[0].device
        self.cols = torch.tensor(self.lens, device=device)
        self.starts = torch.tensor(self.row_pads, device=device)
        self.all_rows = torch.arange(self.rows, device=device)
        self._mask = None

    def column(self):
        """The column every row writes at, when they share one and none is padded (one slice, no mask), else None."""
        if self.active is None and len(set(self.lens)) == 1 and not any(self.row_pads):
            return self.lens[0]
        return None

    def attend(self, slot, q, k, v):
        keys, values = self.store(slot, k, v)
        mask = None if self.column() is not None else self.mask(1, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=q.size(1) != k.size(1))

    def store(self, slot, k, v):
        """Each row's one new key and value written at its own column; the columns up to the longest row's."""
        rows = self.forward_rows(k.device)
        if k.size(2) != 1 or k.size(0) != rows.size(0):
            raise ValueError(f"a RowCache forward feeds each of its {rows.size(0)} rows one token; "
                             f"got {tuple(k.shape)}")
        end = max(self.lens) + 1
        if (col := self.column()) is not None:
            self.k[slot][:self.rows, :, col:end] = k
            self.v[slot][:self.rows, :, col:end] = v
        else:
            cols = self.cols if self.active is None else self.cols[rows]
            self.k[slot][rows, :, cols] = k[:, :, 0]
            self.v[slot][rows, :, cols] = v[:, :, 0]
        if self.active is not None:  # a copy of the rows still refining (halting.forward_halting_rows)
            return self.k[slot][self.active, :, :end], self.v[slot][self.active, :, :end]
        return self.k[slot][:self.rows, :, :end], self.v[slot][:self.rows, :, :end]

    def forward_rows(self, device):
        return self.active if self.active is not None else self.all_rows

    def narrow(self, rows):
        """Forwards from now on compute only these rows (a (B',) index, ascending), or all of them again (None)."""
        self.active = rows
        self._mask = None

    def repeat_step(self, start, stop, slots_per_step, T, rows=None):
        """As KVCache's, for these rows (default: every row) at their own columns."""
        rows = self.forward_rows(self.cols.device) if rows is None else rows
        cols = self.cols[rows]
        for slot in range(start, stop):
            source = slot - slots_per_step
            self.k[slot][rows, :, cols] = self.k[source][rows, :, cols]
            self.v[slot][rows, :, cols] = self.v[source][rows, :, cols]

    def mask(self, T, device):
        """(B, 1, 1, end) bool: a row's new token sees its own columns after its padding, itself included."""
        if self._mask is None:
            k_pos = torch.arange(max(self.lens) + 1, device=device)[None, :]
            visible = (k_pos >= self.starts[:, None]) & (k_pos <= self.cols[:, None])
            self._mask = (visible if self.active is None else visible[self.active])[:, None, None, :]
        return self._mask

    def advance(self, T):
        self.lens = [n + T for n in self.lens]
        self.cols += T
        self._mask = None
        self.halted = None


def forward_at_depths(model, idx, n_sup, depths, kv_cache):
    """Logits (B, T, V) of a forward of n_sup supervision steps in which row b answers from its own step depths[b]
    (a (B,) tensor, each from 1 to n_sup): what the row computes alone at that depth, to float rounding. A step's
    attention reads only its own slots, which the row's earlier tokens filled at that same step, so the steps a row
    runs past its depth change nothing it reads; the coda runs on each row's answer, in the slots of n_sup steps."""
    kept = None
    for s, (y, _) in enumerate(model.refine(idx, n_sup, kv_cache), start=1):
        kept = y.clone() if kept is None else torch.where((depths == s)[:, None, None], y, kept)
    logits = model.head(model.apply_coda(kept, kv_cache, n_sup))
    kv_cache.advance(idx.size(1))
    return logits


def left_pad(prompts, pad_id=0):
    """Token lists -> (idx (B, L) long, pads (B,) long, or None when all rows have the same length)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (prepend <|bos|>)")
    L = max(len(p) for p in prompts)
    idx = torch.tensor([[pad_id] * (L - len(p)) + list(p) for p in prompts], dtype=torch.long)
    pads = torch.tensor([L - len(p) for p in prompts], dtype=torch.long)
    return idx, (pads if pads.any() else None)


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, rng=None):
    """(B, V) logits -> (B,) token ids: greedy at temperature 0, else softmax(logits/T) restricted to the top k
    tokens and to the nucleus: the likeliest tokens holding top_p of the probability (at least one token)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    # max subtracted and T floored at the dtype's smallest normal: a tiny T gives the argmax's mass, not inf/inf = NaN
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(logits.dtype).tiny)
    nucleus = top_p is not None and top_p < 1.0
    if top_k is not None and top_k < logits.size(-1):
        scaled, indices = torch.topk(scaled, top_k, dim=-1)  # sorted, likeliest first
    elif nucleus:
        scaled, indices = scaled.sort(dim=-1, descending=True)
    else:
        indices = None
    probs = F.softmax(scaled, dim=-1)
    if nucleus:
        outside = probs.cumsum(dim=-1) - probs >= top_p  # the likelier tokens already hold top_p
        outside[:, 0] = False
        probs = probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(probs, 1, generator=rng)
    return (choice if indices is None else indices.gather(-1, choice)).squeeze(-1)


class Request(NamedTuple):
    """One request's checked arguments (Engine.prepare): its rows and how to sample them."""
    prompts: list
    max_tokens: int
    temperature: float
    top_k: int | None
    top_p: float | None
    n_sup: int
    halting: Halting | None
    rng: torch.Generator | None
    stops: set


class Engine:
    """Generation with a per-virtual-layer KV cache. Engine(model, tokenizer).complete(["Once upon"]) -> [str].

    autocast: a function returning the context every forward runs in (e.g. bf16 autocast on a GPU, so matmuls and
    the KV cache are bf16). Entered around each forward, not around a call: autocast is per thread, and the server
    iterates a generation on worker threads."""

    def __init__(self, model, tokenizer=None, autocast=contextlib.nullcontext):
        self.model, self.tokenizer, self.autocast = model, tokenizer, autocast
        self.stats = {}  # timings of the last generation: prefill/decode tokens and seconds; "steps" under halting
        self.most_steps = None  # the most supervision steps a request may ask for; None: the model's n_sup_inference

    @property
    def device(self):
        return self.model.lm_head.weight.device

    def check_n_sup(self, n_sup):
        default = self.model.config.n_sup_inference
        n_sup = default if n_sup is None else n_sup
        if not isinstance(n_sup, int) or not 1 <= n_sup <= (self.most_steps or default):
            limit = self.most_steps or f"the model's n_sup_inference={default}"
            raise ValueError(f"n_sup={n_sup!r}: must be an integer from 1 to {limit}")
        return n_sup

    def check_halt(self, halt):
        """None (every token runs n_sup steps), a halting.Halting or its 'RULE:THRESHOLD' string -> None or a
        Halting."""
        if halt is None:
            return None
        return check_halting(self.model, halt if isinstance(halt, Halting) else Halting.parse(halt))

    def stop_tokens(self):
        """The ids of STOP_TOKENS this tokenizer has."""
        stops = set()
        for name in STOP_TOKENS if self.tokenizer is not None else ():
            try:
                stops.add(self.tokenizer.encode_special(name))
            except (KeyError, ValueError):
                pass  # a tokenizer without chat tokens
        return stops

    def new_cache(self, batch_size, max_len, n_sup, pads=None):
        return KVCache(self.model.num_attention_slots(n_sup), batch_size, max_len, pads)

    def generate(self, prompts, max_tokens=64, temperature=1.0, top_k=None, n_sup=None, seed=None, stop_tokens=None,
                 top_p=None, halt=None, stats=None):
        """Stream tokens: an iterator of one list per step holding each row's new token, or None once it stopped.

        prompts: token-id lists of any lengths. Rows stop at a stop token (not yielded) or after max_tokens.
        seed: a private generator, so the same call samples the same tokens whatever else uses torch's RNG.
        halt: per-token adaptive halting within n_sup steps (see check_halt); stats["steps"] then holds, per row, the
        steps run by the position that predicted each yielded token.
        stats: a dict this generation's stats fill instead of self.stats (generations on several threads at once).
        Arguments are checked here, before the first token is asked for.
        """
        request = self.prepare(prompts, max_tokens, temperature, top_k, n_sup, seed, stop_tokens, top_p, halt)
        return (columns[0] for columns in self._decode([request], stats))

    def prepare(self, prompts, max_tokens=64, temperature=1.0, top_k=None, n_sup=None, seed=None, stop_tokens=None,
                top_p=None, halt=None):
        """One request's arguments (as generate's), checked, for generate_together."""
        n_sup = self.check_n_sup(n_sup)
        halting = self.check_halt(halt)
        if not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens!r}: must be an integer >= 0")
        if not temperature >= 0:
            raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k}: must be >= 1, or None for no restriction")
        if top_p is not None and not 0 <= top_p <= 1:
            raise ValueError(f"top_p={top_p}: must be from 0 to 1, or None for no restriction")
        idx, _ = left_pad(prompts)
        vocab_size = self.model.config.vocab_size
        if idx.min() < 0 or idx.max() >= vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {vocab_size}); got {idx.min()}..{idx.max()}")
        if idx.size(1) + max_tokens > self.model.rotary_seq_len:
            raise ValueError(f"prompt of {idx.size(1)} tokens + max_tokens={max_tokens} exceeds the model's "
                             f"longest position ({self.model.rotary_seq_len})")
        stops = self.stop_tokens() if stop_tokens is None else set(stop_tokens)
        rng = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        return Request([list(p) for p in prompts], max_tokens, temperature, top_k, top_p, n_sup, halting, rng, stops)

    def generate_together(self, requests):
        """Several prepared requests in one Batch (shared forwards): an iterator of one list per step holding, per
        request, what generate would yield for it, [None] * rows once it has finished. Each request samples with its
        own options and generator, so its tokens are those it gets alone (to float rounding); it stops at its own
        max_tokens. The requests must share n_sup and halting: they run the same forwards."""
        if len({(r.n_sup, r.halting) for r in requests}) > 1:
            raise ValueError("requests generated together must share n_sup and halting")
        return self._together(requests)

    def new_batch(self, n_sup, halting):
        """An empty Batch of this depth, which requests join (Batch.add) and leave as they come and finish."""
        return Batch(self, n_sup, halting)

    def _together(self, requests):
        batch = self.new_batch(requests[0].n_sup, requests[0].halting)
        members = [batch.add(r) for r in requests]
        while batch:
            columns = dict(batch.step())
            yield [columns.get(m, [None] * len(m.request.prompts)) for m in members]

    def _last_logits(self, idx, cache, n_sup, halting, depths=None):
        """The last position's logits (B, V) of a forward that extends the cache, and (B,) steps it ran; depths:
        each row's own steps, fewer than n_sup for some (forward_at_depths)."""
        with self.autocast():
            if depths is not None:
                return forward_at_depths(self.model, idx, n_sup, depths, cache)[:, -1], None
            if halting is None:
                return self.model(idx, kv_cache=cache, n_sup=n_sup)[:, -1], None
            logits, steps = forward_halting(self.model, idx, halting, cache, n_sup=n_sup)
            return logits[:, -1], steps[:, -1]

    @torch.inference_mode()
    def _decode(self, requests, stats=None):
        """Prefill every request's rows in one forward, then feed each sampled token back one at a time; each
        request's rows are sampled together with its options (as alone, so a seeded request draws the same)."""
        max_tokens = max(r.max_tokens for r in requests)
        if max_tokens == 0:
            return
        n_sup, halting = requests[0].n_sup, requests[0].halting
        prompts = [p for r in requests for p in r.prompts]
        spans, start = [], 0
        for r in requests:
            spans.append((start, start + len(r.prompts)))
            start += len(r.prompts)
        limits = [r.max_tokens for r in requests for _ in r.prompts]
        stops = [r.stops for r in requests for _ in r.prompts]
        idx, pads = left_pad(prompts)
        B = idx.size(0)
        cache = self.new_cache(B, idx.size(1) + max_tokens, n_sup, pads)
        t0 = time.perf_counter()
        logits, steps = self._last_logits(idx.to(self.device), cache, n_sup, halting)
        done = [False] * B
        for step in range(max_tokens):
            tokens = torch.cat([sample_next(logits[a:b], r.temperature, r.top_k, r.top_p, r.rng)
                                for r, (a, b) in zip(requests, spans)])
            column = tokens.tolist()  # syncs the device, so the timings are real
            if step == 0:
                if stats is None:
                    stats = self.stats = {}
                stats.update(prefill_tokens=sum(map(len, prompts)), prefill_s=time.perf_counter() - t0,
                             decode_tokens=0, decode_s=0.0)
                if halting:
                    stats["steps"] = [[] for _ in column]
            else:
                stats["decode_tokens"] += B
                stats["decode_s"] += time.perf_counter() - t0
            done = [d or step >= limit or t in stop for d, t, limit, stop in zip(done, column, limits, stops)]
            for row in range(B) if halting else ():
                if not done[row]:
                    stats["steps"][row].append(int(steps[row]))
            yield [[None if d else t for d, t in zip(done[a:b], column[a:b])] for a, b in spans]
            if all(done) or step == max_tokens - 1:
                return
            t0 = time.perf_counter()
            logits, steps = self._last_logits(tokens[:, None], cache, n_sup, halting)

    def generate_batch(self, prompts, **kwargs):
        """Token-id lists in, the generated token-id lists out (stop tokens excluded). kwargs as generate()."""
        outputs = [[] for _ in prompts]
        for column in self.generate(prompts, **kwargs):
            for out, token in zip(outputs, column):
                if token is not None:
                    out.append(token)
        return outputs

    def encode_prompt(self, text):
        return self.tokenizer.encode(text, prepend=self.tokenizer.get_bos_token_id())

    def complete(self, texts, **kwargs):
        """Prompt strings in, completion strings out: the one call for printing samples. kwargs as generate()."""
        outputs = self.generate_batch([self.encode_prompt(t) for t in texts], **kwargs)
        return [self.tokenizer.decode(ids) for ids in outputs]


class Member:
    """A request in a Batch: which rows of the RowCache are its, which of them are done, how many tokens it has."""

    def __init__(self, request, stats):
        self.request, self.stats = request, stats
        self.done = [False] * len(request.prompts)
        self.tokens = 0  # tokens sampled per row so far
        self.rows = []  # its rows in the RowCache, in its prompts' order, once it has joined
        self.finished = request.max_tokens == 0  # out of the batch: every row done, max_tokens reached, or dropped


class Batch:
    """Requests that decode together, joining and leaving at token boundaries (continuous batching). Each step
    prefills the requests added since the last one (in one forward, left-padded among themselves, into a KVCache then
    copied into the RowCache), feeds every other row its last token in one forward over the RowCache, and samples
    each request's rows with its own options and generator; a finished or dropped request leaves, and its rows are
    freed. A request keeps all its rows, in order, until it leaves, so a seeded one draws what it draws alone.
    Without halting, a request of fewer steps than the batch's n_sup joins too, its rows answering from their own
    last step (forward_at_depths): one forward serves every depth up to the batch's."""

    def __init__(self, engine, n_sup, halting):
        self.engine, self.n_sup, self.halting = engine, n_sup, halting
        self.cache = RowCache(engine.model.num_attention_slots(n_sup))
        self.members, self.joining = [], []
        self.tokens = None  # (rows,) each row's last sampled token: the next step's input

    def __len__(self):
        return len(self.members) + len(self.joining)

    @property
    def rows(self):
        return self.cache.rows

    def admits(self, request):
        """Whether the request may join: the batch's depth and halting rule, or without halting any depth up to it."""
        if self.halting is None and request.halting is None:
            return request.n_sup <= self.n_sup
        return (request.n_sup, request.halting) == (self.n_sup, self.halting)

    def add(self, request, stats=None):
        """A prepared request joins at the next step; returns its Member (stats: a dict its stats fill)."""
        if not self.admits(request):
            raise ValueError(f"a request of n_sup {request.n_sup} and halting {request.halting} cannot join a batch "
                             f"of n_sup {self.n_sup} and halting {self.halting}: requests generated together must "
                             f"share n_sup and halting, or without halting run at most the batch's n_sup")
        member = Member(request, {} if stats is None else stats)
        if not member.finished:
            self.joining.append(member)
        return member

    def drop(self, member):
        """The request leaves before the next step (its client went away)."""
        member.finished = True

    def groups(self, members):
        """Joiners split so that each group's longest prompt plus its most max_tokens fits the rotary table: a short
        prompt is padded to its group's longest."""
        groups, most = [], self.engine.model.rotary_seq_len
        for m in members:
            for group in groups:
                if max(self.longest(group + [m])) <= most:
                    group.append(m)
                    break
            else:
                groups.append([m])
        return groups

    def depths(self, members, rows, joining=False):
        """(rows,) each row's steps on the device, in the RowCache's order (joining: the members' own, in turn), or
        None when every row runs the batch's n_sup (the plain forward)."""
        if all(m.request.n_sup == self.n_sup for m in members):
            return None
        depths = [0] * rows
        start = 0
        for m in members:
            places = range(start, start + len(m.done)) if joining else m.rows
            start += len(m.done)
            for row in places:
                depths[row] = m.request.n_sup
        return torch.tensor(depths, device=self.engine.device)

    @staticmethod
    def longest(members):
        """(the longest prompt plus the most max_tokens, the longest prompt) of these members."""
        prompt = max(len(p) for m in members for p in m.request.prompts)
        return prompt + max(m.request.max_tokens for m in members), prompt

    @torch.inference_mode()
    def step(self):
        """One token for each request in the batch: [(member, column)], column as generate yields it. A member
        finished by this step has .finished set and has left."""
        self.leave()
        self.joining = [m for m in self.joining if not m.finished]
        t0 = time.perf_counter()
        logits, steps, sampled = [], [], []
        if self.members:
            row_logits, row_steps = self.engine._last_logits(self.tokens[:, None], self.cache, self.n_sup,
                                                             self.halting, self.depths(self.members, self.rows))
            logits.append(row_logits)
            steps.append(row_steps)
        joined = []
        for group in self.groups(self.joining):
            idx, pads = left_pad([p for m in group for p in m.request.prompts])
            cache = self.engine.new_cache(idx.size(0), idx.size(1), self.n_sup, pads)
            row_logits, row_steps = self.engine._last_logits(idx.to(self.engine.device), cache, self.n_sup,
                                                             self.halting, self.depths(group, idx.size(0), True))
            start = self.rows
            for m in group:
                m.rows, start = list(range(start, start + len(m.done))), start + len(m.done)
                joined.append(m)
            logits.append(row_logits)
            steps.append(row_steps)
            self.cache.join(cache, self.longest(group)[0])
        self.joining = []
        if not logits:  # every request was dropped
            return []
        logits = torch.cat(logits)
        steps = torch.cat(steps).tolist() if self.halting else None
        members = self.members + joined
        for m in members:
            r = m.request
            sampled.append(sample_next(logits[m.rows], r.temperature, r.top_k, r.top_p, r.rng))
        self.tokens = torch.empty(self.rows, dtype=torch.long, device=logits.device)
        for m, tokens in zip(members, sampled):
            self.tokens[m.rows] = tokens
        column = self.tokens.tolist()  # syncs the device, so the timings are real
        elapsed = time.perf_counter() - t0
        out = []
        for m in members:
            rows = m.rows
            if m.tokens == 0:
                m.stats.update(prefill_tokens=sum(map(len, m.request.prompts)), prefill_s=elapsed, decode_tokens=0,
                               decode_s=0.0)
                if self.halting:
                    m.stats["steps"] = [[] for _ in rows]
            else:
                m.stats["decode_tokens"] += len(rows)
                m.stats["decode_s"] += elapsed
            m.done = [d or column[row] in m.request.stops for d, row in zip(m.done, rows)]
            for i, row in enumerate(rows) if self.halting else ():
                if not m.done[i]:
                    m.stats["steps"][i].append(steps[row])
            out.append((m, [None if d else column[row] for d, row in zip(m.done, rows)]))
            m.tokens += 1
            m.finished = all(m.done) or m.tokens == m.request.max_tokens
        self.members = members
        self.leave()
        return out

    def leave(self):
        """Finished members out of the batch, their rows freed (the last rows move into the places freed)."""
        if all(not m.finished for m in self.members):
            return
        gone = [r for m in self.members if m.finished for r in m.rows]
        self.members = [m for m in self.members if not m.finished]
        order = self.cache.free(gone)
        now = {old: new for new, old in enumerate(order)}
        for m in self.members:
            m.rows = [now[r] for r in m.rows]
        self.tokens = self.tokens[order] if order else None


def ends_mid_character(text):
    """Whether decoded text ends inside a character: one character's bytes can span several tokens, and decode shows
    the first ones as U+FFFD until the last arrives, so a stream holds the text back until then."""
    return text.endswith("\ufffd")
