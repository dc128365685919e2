"""Distributed tokenizing data loader with exact resume.

The split's documents are dealt out to the data ranks (processes x accumulation steps): each rank reads every
world_size-th row group; with more ranks than row groups, each row group's documents are dealt out in turn to the
ranks that share it; and when even that would leave a rank without documents (a tiny split, e.g. a validation shard
of one document), every rank reads the whole split and keeps every world_size-th batch. Ranks never overlap and
together cover the split. Each rank tokenizes its documents in batches (<|bos|> first in each) and cuts its token
stream into (B, T+1) windows: inputs are a window's first T tokens, targets its last T. Small corpora are read epoch
after epoch.

The position after each batch (epoch, shard, row group, document, token within it) is the whole state:
tokenization is deterministic, so a loader started there yields exactly the batches that would have come next.
"""

import math
import os
from collections import deque

import torch

from nanochat.common import get_dist_info
from nanochat.dataset import DatasetError, parquets_for_split, read_texts, row_group_sizes

STATE_KEYS = ("epoch", "shard", "row_group", "doc", "token")


def plan_shares(paths, rank, world_size):
    """(this rank's shares, batch stride). A share (path, row group, first doc, doc stride) is the documents
    first, first + stride, ... of one row group; the batch stride is 1, or world_size for a split too small to deal
    out by documents (every rank then reads it all and keeps every world_size-th batch)."""
    groups = [(path, g, n) for path in paths for g, n in enumerate(row_group_sizes(path))]
    if not any(n for *_, n in groups):
        raise DatasetError(f"{', '.join(paths)} hold(s) no documents; rebuild the corpus")
    parts = math.ceil(world_size / len(groups))  # > 1 only with more ranks than row groups
    shares = [(path, g, p, parts, n) for path, g, n in groups for p in range(parts)]

    def num_docs(r):
        return sum(len(range(p, n, parts)) for *_, p, parts, n in shares[r::world_size])

    if all(num_docs(r) for r in range(world_size)):
        return [share[:4] for share in shares[rank::world_size]], 1
    return [(path, g, 0, 1) for path, g, _ in groups], world_size


class DataLoader:

    def __init__(self, tokenizer, B, T, split, device="cpu", rank=None, world_size=None, resume_state=None,
                 data_dir=None, tokenizer_threads=4, tokenizer_batch_size=128):
        _, dist_rank, _, dist_world_size = get_dist_info()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world_size if world_size is None else world_size
        self.tokenizer, self.B, self.T = tokenizer, B, T
        self.device = torch.device(device)
        self.tokenizer_threads, self.tokenizer_batch_size = tokenizer_threads, tokenizer_batch_size
        self.shares, self.stride = plan_shares(parquets_for_split(split, data_dir), self.rank, self.world_size)
        self.names = [(os.path.basename(path), g) for path, g, _, _ in self.shares]
        self.position = self.check_state(resume_state) if resume_state else self.state_at(0, 0, self.shares[0][2], 0)
        self.windows = self.generate_windows()
        if self.stride > 1 and not resume_state:  # batches are dealt out in turn: rank r's first is the r-th
            for _ in range(self.rank):
                _, self.position = next(self.windows)
        self.batches = self.generate_batches()

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
        return next(self.batches)

    def documents(self):
        """(epoch, share index, doc index, token ids) from the current position on, looping over epochs."""
        bos = self.tokenizer.get_bos_token_id()
        epoch, doc = self.position["epoch"], self.position["doc"]
        start = self.names.index((self.position["shard"], self.position["row_group"]))
        while True:
            for index in range(start, len(self.shares)):
                path, group, first, stride = self.shares[index]
                texts = read_texts(path, group)
                mine = range(first if doc is None else doc, len(texts), stride)
                for i in range(0, len(mine), self.tokenizer_batch_size):
                    ids = mine[i:i + self.tokenizer_batch_size]
                    encoded = self.tokenizer.encode([texts[j] for j in ids], prepend=bos,
                                                    num_threads=self.tokenizer_threads)
                    yield from ((epoch, index, j, tokens) for j, tokens in zip(ids, encoded))
                doc = None
            start, epoch = 0, epoch + 1

    def generate_windows(self):
        """(B*(T+1) tokens, the position after them) of this rank's document stream."""
        needed = self.B * (self.T + 1)
        documents = self.documents()
        pending = deque()  # [epoch, share index, doc index, tokens, tokens already used]
        skip = self.position["token"]  # resuming mid-document
        buffered = 0
        while True:
            # keep at least one token past the window, so the next window's start is a buffered document
            while buffered <= needed:
                epoch, index, doc, tokens = next(documents)
                pending.append([epoch, index, doc, tokens, skip])
                buffered += len(tokens) - skip
                skip = 0
            window = []
            while len(window) < needed:
                head = pending[0]
                take = min(needed - len(window), len(head[3]) - head[4])
                window.extend(head[3][head[4]:head[4] + take])
                head[4] += take
                if head[4] == len(head[3]):
                    pending.popleft()
            buffered -= needed
            epoch, index, doc, _, used = pending[0]
            yield window, self.state_at(epoch, index, doc, used)

    def generate_batches(self):
        while True:
            window, self.position = next(self.windows)
            for _ in range(self.stride - 1):  # the other ranks' batches of a split read by every rank
                _, self.position = next(self.windows)
            yield self.to_device(torch.tensor(window, dtype=torch.long).view(self.B, self.T + 1))

    def to_device(self, windows):
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return (inputs.pin_memory().to(self.device, non_blocking=True),
                    targets.pin_memory().to(self.device, non_blocking=True))
        return inputs.to(self.device), targets.to(self.device)
