"""Distributed tokenizing data loader with exact resume.

The split's documents are dealt out to the data ranks (processes x accumulation steps): each rank reads every
world_size-th row group; with more ranks than row groups, each row group's documents are dealt out in turn to the
ranks that share it; and when even that would leave a rank without documents (a tiny split, e.g. a validation shard
of one document), every rank reads the whole split and keeps every world_size-th batch. Ranks never overlap and
together cover the split. Each rank tokenizes its documents (<|bos|> first in each) and cuts its token
stream into (B, T+1) windows: inputs are a window's first T tokens, targets its last T. Small corpora are read epoch
after epoch.

Two row layouts (rows=): "stream" cuts the rows from the token stream, so most rows start mid-document and every
token trains (text: nothing is lost). "documents" starts every row at a document: whole documents in order while they
fit, the rest of the row unscored (target -1), and a document longer than a row continued at the start of the next.
A corpus whose tokens mean nothing without their document's start (a lookup table and its queries, --synthetic=hops)
needs it: cut mid-document, a row's queries lose their table, and the default recursion was seen to stay at chance
where one document per row learns (dev/LOG.md, issue 36).

The position after each batch (epoch, shard, row group, document, token within it) is the whole state:
tokenization is deterministic, so a loader started there yields exactly the batches that would have come next.

Memory stays flat in the number of loaders (base_train holds one per accumulation step): a loader tokenizes only
the documents its next few windows need and keeps their tokens as int32, and row groups' texts come from a small
cache shared by all loaders of the process.

Training loaders (prefetch=True) read and tokenize the next WINDOWS_AHEAD windows' documents in a background thread
once fewer than half of them are left, so a step never waits for the tokenizer (it did every WINDOWS_AHEAD windows:
the depth run's slow step every ~8). The documents are chosen in order and taken in order: the batches and the
positions are those of the synchronous loader, and a read error surfaces where it would have.
"""

import functools
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from nanochat.common import get_dist_info
from nanochat.data.dataset import DatasetError, parquets_for_split, read_texts, row_group_sizes

STATE_KEYS = ("epoch", "shard", "row_group", "doc", "token")
ROW_LAYOUTS = ("stream", "documents")
UNSCORED = -1  # a "documents" row's padding: the loss's ignore_index as a target, a valid token id (0) as an input
CHARS_PER_TOKEN = 4  # about right for English BPE: sizes how many documents to tokenize for a window
WINDOWS_AHEAD = 8  # tokenized when a loader runs short: one row-group read (on a cache miss) serves several windows
ROW_GROUPS_CACHED = 4


# base_train's micro-steps walk the data ranks in order, and neighbouring ranks share row groups when there are
# more ranks than row groups: a few cached row groups serve them all
cached_texts = functools.lru_cache(maxsize=ROW_GROUPS_CACHED)(read_texts)


@functools.cache
def background():
    """The process's one tokenizing thread: the loaders' reads queue in it, one at a time, in the order asked."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")


def plan_shares(paths, rank, world_size):
    """(this rank's shares, batch stride). A share (path, row group, first doc, doc stride, documents in the row
    group) is the documents first, first + stride, ... of one row group; the batch stride is 1, or world_size for a
    split too small to deal out by documents (every rank then reads it all and keeps every world_size-th batch)."""
    groups = [(path, g, n) for path in paths for g, n in enumerate(row_group_sizes(path))]
    if not any(n for *_, n in groups):
        raise DatasetError(f"{', '.join(paths)} hold(s) no documents; rebuild the corpus")
    parts = math.ceil(world_size / len(groups))  # > 1 only with more ranks than row groups
    shares = [(path, g, p, parts, n) for path, g, n in groups for p in range(parts)]

    def num_docs(r):
        return sum(len(range(p, n, parts)) for *_, p, parts, n in shares[r::world_size])

    if all(num_docs(r) for r in range(world_size)):
        return shares[rank::world_size], 1
    return [(path, g, 0, 1, n) for path, g, n in groups], world_size


class DataLoader:

    def __init__(self, tokenizer, B, T, split, device="cpu", rank=None, world_size=None, resume_state=None,
                 data_dir=None, tokenizer_threads=4, tokenizer_batch_size=128, rows="stream", prefetch=False):
        _, dist_rank, _, dist_world_size = get_dist_info()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world_size if world_size is None else world_size
        if rows not in ROW_LAYOUTS:
            raise ValueError(f"rows={rows!r}: choose one of {', '.join(ROW_LAYOUTS)}")
        self.tokenizer, self.B, self.T, self.rows = tokenizer, B, T, rows
        self.device = torch.device(device)
        self.tokenizer_threads, self.tokenizer_batch_size = tokenizer_threads, tokenizer_batch_size
        self.shares, self.stride = plan_shares(parquets_for_split(split, data_dir), self.rank, self.world_size)
        self.names = [(os.path.basename(path), g) for path, g, *_ in self.shares]
        self.position = self.check_state(resume_state) if resume_state else self.state_at(0, 0, self.shares[0][2], 0)
        self.upcoming = self.documents()
        self.pending = deque()  # tokenized documents: [epoch, share index, doc index, int32 tokens, tokens used]
        self.buffered = 0  # unused tokens in pending
        self.skip = self.position["token"]  # resuming mid-document
        self.prefetch = prefetch
        self.inflight = None  # the future of the next documents' tokens, read in the background (prefetch)
        if self.stride > 1 and not resume_state:  # batches are dealt out in turn: rank r's first is the r-th
            for _ in range(self.rank):
                self.next_window()

    def state_at(self, epoch, share_index, doc, token):
        shard, row_group = self.names[share_index]
        return {"epoch": epoch, "shard": shard, "row_group": row_group, "doc": doc, "token": token}

    def check_state(self, state):
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"resume_state lacks {missing}; pass a dict from DataLoader.state_dict()")
        key = (state["shard"], state["row_group"])
        share = self.shares[self.names.index(key)] if key in self.names else None
        if share is None or state["doc"] % share[3] != share[2]:  # a document of another rank's share
            raise ValueError(f"resume_state points at {state['shard']} row group {state['row_group']} document "
                             f"{state['doc']}, which rank {self.rank} of {self.world_size} does not read: the shards "
                             "or the world size changed")
        return {key: state[key] for key in STATE_KEYS}

    def state_dict(self):
        """Where the next batch starts; JSON-serialisable."""
        return dict(self.position)

    def __iter__(self):
        return self

    def __next__(self):
        window = self.next_window()
        for _ in range(self.stride - 1):  # the other ranks' batches of a split read by every rank
            self.next_window()
        return self.to_device(window.long().view(self.B, self.T + 1))

    def documents(self):
        """(epoch, share index, doc index) of this rank's documents from the current position on, looping over
        epochs."""
        epoch, doc = self.position["epoch"], self.position["doc"]
        start = self.names.index((self.position["shard"], self.position["row_group"]))
        while True:
            for index in range(start, len(self.shares)):
                _, _, first, stride, num_docs = self.shares[index]
                yield from ((epoch, index, j) for j in range(first if doc is None else doc, num_docs, stride))
                doc = None
            start, epoch = 0, epoch + 1

    def read_and_encode(self, missing):
        """The next few documents, tokenized: about enough characters for `missing` tokens, at least one document, at
        most tokenizer_batch_size; [(epoch, share index, doc index, int32 tokens)]. Advances self.upcoming, so one
        call at a time (the background job is taken before any other)."""
        chosen, texts, chars = [], [], 0
        while chars < CHARS_PER_TOKEN * missing and len(texts) < self.tokenizer_batch_size:
            epoch, index, doc = next(self.upcoming)
            path, group, *_ = self.shares[index]
            chosen.append((epoch, index, doc))
            texts.append(cached_texts(path, group)[doc])
            chars += len(texts[-1])
        encoded = self.tokenizer.encode(texts, prepend=self.tokenizer.get_bos_token_id(),
                                        num_threads=self.tokenizer_threads)
        return [(*where, torch.tensor(ids, dtype=torch.int32)) for where, ids in zip(chosen, encoded)]

    def take(self, documents):
        for epoch, index, doc, tokens in documents:
            self.pending.append([epoch, index, doc, tokens, self.skip])
            self.buffered += len(tokens) - self.skip
            self.skip = 0

    def fill(self, needed, ahead):
        """At least needed + 1 tokens buffered: the background job's documents first, then (none in flight) `ahead`
        tokens' worth read here."""
        while self.buffered <= needed:
            if self.inflight is not None:
                documents, self.inflight = self.inflight.result(), None  # its read error is raised here
                self.take(documents)
            else:
                self.take(self.read_and_encode(ahead - self.buffered))

    def read_ahead(self, window):
        """prefetch: once fewer than half of WINDOWS_AHEAD windows are buffered, the next WINDOWS_AHEAD windows'
        documents are read and tokenized in the background."""
        if self.prefetch and self.inflight is None and self.buffered < WINDOWS_AHEAD // 2 * window:
            self.inflight = background().submit(self.read_and_encode, WINDOWS_AHEAD * window)

    def next_window(self):
        """The next B*(T+1) tokens of this rank's document stream (int32), laid out as self.rows says; moves the
        position past them."""
        if self.rows == "documents":
            return self.next_document_rows()
        needed = self.B * (self.T + 1)
        # keep at least one token past the window, so the next window's start is a tokenized document
        self.fill(needed, WINDOWS_AHEAD * needed + 1)
        pieces, filled = [], 0
        while filled < needed:
            head = self.pending[0]
            tokens, used = head[3], head[4]
            take = min(needed - filled, len(tokens) - used)
            pieces.append(tokens[used:used + take])
            filled += take
            head[4] += take
            if head[4] == len(tokens):
                self.pending.popleft()
        self.buffered -= needed
        epoch, index, doc, _, used = self.pending[0]
        self.position = self.state_at(epoch, index, doc, used)
        self.read_ahead(needed)
        return torch.cat(pieces)

    def next_document_rows(self):
        """B rows of T+1 (int32, flattened), each from the start of the next document (or the rest of one longer than
        a row): whole documents while they fit, then UNSCORED."""
        width = self.T + 1
        rows = torch.full((self.B, width), UNSCORED, dtype=torch.int32)
        for row in rows:
            filled = 0
            while filled < width:
                self.fill(0, WINDOWS_AHEAD * self.B * width)  # buffered > 0: a document is pending
                head = self.pending[0]
                tokens, used = head[3], head[4]
                left = len(tokens) - used
                if filled and left > width - filled:  # a document starts the next row rather than being cut
                    break
                take = min(left, width - filled)
                row[filled:filled + take] = tokens[used:used + take]
                filled, head[4], self.buffered = filled + take, used + take, self.buffered - take
                if head[4] == len(tokens):
                    self.pending.popleft()
        self.fill(0, WINDOWS_AHEAD * self.B * width)  # the position names the next document: it must be tokenized
        epoch, index, doc, _, used = self.pending[0]
        self.position = self.state_at(epoch, index, doc, used)
        self.read_ahead(self.B * width)
        return rows.view(-1)

    def to_device(self, windows):
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.rows == "documents":  # UNSCORED padding as an input: any valid id, its outputs are not scored
            inputs.clamp_(min=0)
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return (inputs.pin_memory().to(self.device, non_blocking=True),
                    targets.pin_memory().to(self.device, non_blocking=True))
        return inputs.to(self.device), targets.to(self.device)


# ---------------------------------------------------------------------------------------------------- evaluation
def evaluation_size(num_tokens, B, T, world_size):
    """(rows, batches per rank) of an evaluation of num_tokens: num_tokens rounded down to whole rows of T tokens
    (at least one row), in batches of B, dealt out to world_size ranks (every rank runs the same number)."""
    rows = max(1, num_tokens // T)
    return rows, math.ceil(math.ceil(rows / B) / world_size)


EVALUATIONS_CACHED = 2
# this rank's rows of the evaluations read in full, by their arguments: base_train evaluates the same rows every time
evaluation_cache = {}


def evaluation_batches(tokenizer, B, T, split, num_tokens, rank, world_size, device="cpu", data_dir=None):
    """This rank's evaluation batches (x, y) on device, evaluation_size(...)[1] of them; the evaluated rows depend on
    the split, num_tokens, B and T, not on world_size.

    The rows are the first evaluation_size(...)[0] rows of the split's one-process stream (what DataLoader yields on
    one process, row after row), cut into batches of B in order; rank r takes batches r, r + W, r + 2W, ... Rows past
    the last (a short last batch, a rank with one batch fewer) are padding with ignored targets (-1), which
    evaluate_bpb counts as nothing. Every rank reads the stream up to its last row, batch by batch (an evaluation
    stopped early has read no more than it used), and keeps the rows of an evaluation read in full."""
    key = (tokenizer, B, T, split, num_tokens, rank, world_size, data_dir)
    for x, y in evaluation_cache.get(key) or read_evaluation_rows(key):
        yield x.long().to(device), y.long().to(device)


def read_evaluation_rows(key):
    """evaluation_batches' batches as int32, read from the stream; cached when the last one is read."""
    tokenizer, B, T, split, num_tokens, rank, world_size, data_dir = key
    rows, steps = evaluation_size(num_tokens, B, T, world_size)
    stream, read, batches = DataLoader(tokenizer, 1, T, split, rank=0, world_size=1, data_dir=data_dir), 0, []
    for i in range(steps):
        first = (i * world_size + rank) * B
        x, y = torch.zeros(B, T, dtype=torch.int32), torch.full((B, T), -1, dtype=torch.int32)
        for slot in range(max(0, min(B, rows - first))):
            for _ in range(first + slot - read):  # the other ranks' rows
                stream.next_window()
            window, read = stream.next_window(), first + slot + 1
            x[slot], y[slot] = window[:-1], window[1:]
        batches.append((x, y))
        if i == steps - 1:  # before the last yield: a reader asks for exactly `steps` batches
            evaluation_cache[key] = batches
            while len(evaluation_cache) > EVALUATIONS_CACHED:
                evaluation_cache.pop(next(iter(evaluation_cache)))
        yield x, y


# ---------------------------------------------------------------------------------------------------- training
def data_ranks(rank, grad_accum):
    """The data ranks (of world_size x grad_accum) that process `rank` reads in its micro-steps, in order."""
    return [rank * grad_accum + j for j in range(grad_accum)]


def training_loaders(run_config, tokenizer, rank, resume_states, device="cpu"):
    """Process `rank`'s training loaders, one per micro-step (its data ranks), at their resume positions (None: the
    start), for the batch geometry of run_config (a RunConfig). Also how a resume checks that the saved positions
    exist in the current data."""
    return [DataLoader(tokenizer, run_config.device_batch_size, run_config.max_seq_len, "train", device=device,
                       rank=data_rank, world_size=run_config.world_size * run_config.grad_accum, resume_state=state,
                       rows=run_config.rows, prefetch=True)
            for data_rank, state in zip(data_ranks(rank, run_config.grad_accum), resume_states)]
