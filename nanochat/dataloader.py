"""Distributed tokenizing data loader with exact resume.

Each rank reads every world_size-th row group of the split's shards, tokenizes documents in batches
(<|bos|> first in each), and cuts the token stream into (B, T+1) windows: inputs are a window's first T tokens,
targets its last T. Small corpora are read epoch after epoch.

The position after each batch (epoch, shard, row group, document, token within it) is the whole state:
tokenization is deterministic, so a loader started there yields exactly the batches that would have come next.
"""

import os
from collections import deque

import pyarrow.parquet as pq
import torch

from nanochat.common import get_dist_info
from nanochat.dataset import parquets_for_split

STATE_KEYS = ("epoch", "shard", "row_group", "doc", "token")


def rank_row_groups(paths, rank, world_size):
    """(path, row group) pairs of this rank: every world_size-th of the split's row groups, so ranks never overlap."""
    groups = [(path, g) for path in paths for g in range(pq.ParquetFile(path).num_row_groups)]
    mine = groups[rank::world_size]
    if not mine:
        raise ValueError(f"the split has {len(groups)} row groups, fewer than the {world_size} ranks; "
                         "use fewer ranks or a corpus with more row groups")
    return mine


class DataLoader:

    def __init__(self, tokenizer, B, T, split, device="cpu", rank=None, world_size=None, resume_state=None,
                 data_dir=None, tokenizer_threads=4, tokenizer_batch_size=128):
        _, dist_rank, _, dist_world_size = get_dist_info()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world_size if world_size is None else world_size
        self.tokenizer, self.B, self.T = tokenizer, B, T
        self.device = torch.device(device)
        self.tokenizer_threads, self.tokenizer_batch_size = tokenizer_threads, tokenizer_batch_size
        self.row_groups = rank_row_groups(parquets_for_split(split, data_dir), self.rank, self.world_size)
        self.names = [(os.path.basename(path), g) for path, g in self.row_groups]
        self.position = self.check_state(resume_state) if resume_state else self.state_at(0, 0, 0, 0)
        self.batches = self.generate_batches()

    def state_at(self, epoch, group_index, doc, token):
        shard, row_group = self.names[group_index]
        return {"epoch": epoch, "shard": shard, "row_group": row_group, "doc": doc, "token": token}

    def check_state(self, state):
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"resume_state lacks {missing}; pass a dict from DataLoader.state_dict()")
        if (state["shard"], state["row_group"]) not in self.names:
            raise ValueError(f"resume_state points at {state['shard']} row group {state['row_group']}, which rank "
                             f"{self.rank} of {self.world_size} does not read: the shards or the world size changed")
        return {key: state[key] for key in STATE_KEYS}

    def state_dict(self):
        """Where the next batch starts; JSON-serialisable."""
        return dict(self.position)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.batches)

    def documents(self):
        """(epoch, row group index, doc index, token ids) from the current position on, looping over epochs."""
        bos = self.tokenizer.get_bos_token_id()
        epoch, doc = self.position["epoch"], self.position["doc"]
        start = self.names.index((self.position["shard"], self.position["row_group"]))
        while True:
            for index in range(start, len(self.row_groups)):
                path, group = self.row_groups[index]
                texts = pq.ParquetFile(path).read_row_group(group, columns=["text"]).column("text").to_pylist()
                for first in range(doc, len(texts), self.tokenizer_batch_size):
                    chunk = texts[first:first + self.tokenizer_batch_size]
                    encoded = self.tokenizer.encode(chunk, prepend=bos, num_threads=self.tokenizer_threads)
                    for offset, tokens in enumerate(encoded):
                        yield epoch, index, first + offset, tokens
                doc = 0
            start, epoch = 0, epoch + 1

    def generate_batches(self):
        needed = self.B * (self.T + 1)
        documents = self.documents()
        pending = deque()  # [epoch, group index, doc index, tokens, tokens already used]
        skip = self.position["token"]  # resuming mid-document
        buffered = 0
        while True:
            # keep at least one token past the batch, so the next batch's start is a buffered document
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
            self.position = self.state_at(epoch, index, doc, used)
            yield self.to_device(torch.tensor(window, dtype=torch.long).view(self.B, self.T + 1))

    def to_device(self, windows):
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned host memory lets the copy overlap with compute
            return (inputs.pin_memory().to(self.device, non_blocking=True),
                    targets.pin_memory().to(self.device, non_blocking=True))
        return inputs.to(self.device), targets.to(self.device)
