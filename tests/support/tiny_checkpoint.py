"""A tiny trained tokenizer and model saved as real checkpoints, for the engine, sampling-CLI and server tests."""

import pytest
import torch

from nanochat.checkpoint.writer import save_checkpoint
from nanochat.data.tokenizer import RustBPETokenizer, tokenizer_dir
from nanochat.model.gpt import GPT
from tests.support.helpers import tiny_config

MODEL_TAG = "tiny"
TEXT = "the cat sat on the mat. the dog sat on the log. " * 40
TRAIN_STEPS = 40


def build_tiny_checkpoint():
    """Train and save under the current $NANOCHAT_BASE_DIR: steps 20 (best val bpb) and 40 (latest)."""
    tokenizer = RustBPETokenizer.train_from_iterator(iter([TEXT]), 300)
    tokenizer.save(tokenizer_dir())
    ids = torch.tensor(tokenizer.encode(TEXT, prepend="<|bos|>"))
    # the TRM's one-step gradient at a fixed step count, spelled out: what this model always trained with, so that
    # its steps 1 and 2 answer differently, as the serving tests ask
    config = tiny_config(sequence_len=32, vocab_size=tokenizer.get_vocab_size(), n_head=2, n_kv_head=1, n_sup_train=3,
                         detach_between_steps=True, sample_n_sup=False, backprop_steps=1)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    T = config.sequence_len
    g = torch.Generator().manual_seed(0)
    for step in range(1, TRAIN_STEPS + 1):
        starts = torch.randint(0, len(ids) - T - 1, (8,), generator=g)
        x = torch.stack([ids[s:s + T] for s in starts])
        y = torch.stack([ids[s + 1:s + T + 1] for s in starts])
        loss, _ = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 20 == 0:
            fake_bpb = [1.0, 0.5] if step == 20 else [1.0, 0.9]  # makes "best" (20) differ from "latest" (40)
            meta = {"model_config": config.to_dict(), "val_bpb": fake_bpb,
                    "tokenizer_fingerprint": tokenizer.fingerprint()}
            save_checkpoint(MODEL_TAG, step, model, [optimizer], meta, rank_state={})
    model.eval()
    return model, tokenizer


_session = {}


def tiny_checkpoint(tmp_path_factory):
    """(base_dir, model, tokenizer), built once per test session however many test modules ask for it."""
    if not _session:
        base_dir = tmp_path_factory.mktemp("nanochat")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
            _session["built"] = (base_dir, *build_tiny_checkpoint())
    return _session["built"]
