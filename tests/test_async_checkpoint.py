"""Checkpoints written in the background (--async_checkpoint, the default), in process on a tiny model: the files and
the resume of a synchronous save, a save that blocks only for the snapshot, a failed background write that stops the
run in one line with exit 5, and a stop signal while a write is in flight."""

import json
import os
import signal
import threading

import pytest
import torch

from nanochat.checkpoint import manager as ckpt
from nanochat.checkpoint import writer as checkpoint_writer
from nanochat.checkpoint.writer import CheckpointWriter
from nanochat.train import lifecycle
from nanochat.train.optim import setup_optimizers
from scripts import base_train
from tests.support.helpers import TINY, ckpt_dir, exit_code, private_base_dir, random_model, tiny_config, weights
from tests.support.unwritable import FullDiskFile, one_line, temporaries

FLAGS = TINY + ["--eval_every=0", "--save_every=2"]
WAIT_S = 20  # an event's wait in a stub: only a broken save ever waits this long
RUN_DIFFERENCES = ("elapsed_seconds", "cost", "user_flags", "train_config")  # the clock and the flags that differ


@pytest.fixture
def base(base_dir, tmp_path, monkeypatch):
    return private_base_dir(base_dir, tmp_path, monkeypatch)


def train(*flags):
    return exit_code(base_train.main, *flags)


def same(a, b):
    """Two loaded checkpoint values are equal: tensors bit for bit, containers member by member."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def checkpoint_files(base, tag, step):
    """(weights' bytes, the rank file loaded, meta.json less what differs between two runs of the same flags)."""
    directory = ckpt_dir(base, tag, step)
    with open(os.path.join(directory, "model.safetensors"), "rb") as f:
        model = f.read()
    with open(os.path.join(directory, "meta.json")) as f:
        meta = {k: v for k, v in json.load(f).items() if k not in RUN_DIFFERENCES}
    return model, torch.load(os.path.join(directory, "rank_0.pt"), weights_only=True), meta


def writer_threads(monkeypatch):
    """The names of the threads that write checkpoint files, from now on."""
    names, real = [], checkpoint_writer._write
    monkeypatch.setattr(checkpoint_writer, "_write", lambda path, data: names.append(threading.current_thread().name)
                        or real(path, data))
    return names


def test_an_async_save_writes_what_a_synchronous_one_does_and_resumes_bit_identically(base, monkeypatch):
    names = writer_threads(monkeypatch)
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=sync", "--async_checkpoint=0") == 0
    assert set(names) == {"MainThread"}
    names.clear()
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=async", "--async_checkpoint=1") == 0
    assert set(names) == {"checkpoint-writer"}
    for step in (2, 4):
        assert all(same(a, b) for a, b in zip(checkpoint_files(base, "sync", step), checkpoint_files(base, "async",
                                                                                                      step))), step
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=async", "--resume") == 0
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=straight", "--async_checkpoint=0") == 0
    assert same(weights(base, "async", 6), weights(base, "straight", 6))


def test_a_save_blocks_only_for_the_snapshot_and_writes_the_state_at_the_save(base, monkeypatch):
    """The writer is held until the caller's save() has returned (an event, no clock): a save that waited for the
    write would find it never released. Weights and optimizer state changed after save() returned stay out of it."""
    model = random_model(tiny_config())
    optimizers = setup_optimizers(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for opt in optimizers:
        opt.step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_optim = [checkpoint_writer.host_copy(opt.state_dict()) for opt in optimizers]
    returned, held = threading.Event(), []
    real = checkpoint_writer._write

    def slow_write(path, data):
        held.append(returned.wait(WAIT_S))
        real(path, data)

    monkeypatch.setattr(checkpoint_writer, "_write", slow_write)
    with CheckpointWriter(background=True) as writer:
        writer.save("slow", 1, model, optimizers, {"model_config": model.config.to_dict()}, {"loaders": [7]})
        returned.set()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        for opt in optimizers:
            opt.step()  # the optimizer state moves on too
    assert held and all(held), "save() returned only after the write it should have left to the writer"
    assert same(ckpt.load_model_weights("slow", 1, "cpu"), expected)
    rank_file = ckpt.load_rank_state("slow", 1, 0)
    assert same(rank_file["optimizers"], expected_optim) and rank_file["loaders"] == [7]


def test_a_failed_background_write_stops_the_run_at_the_next_save_in_one_line_exit_5(base, monkeypatch, capsys):
    names, real_open = [], open

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and "step_000002" in str(path):
            names.append(threading.current_thread().name)
            return FullDiskFile(f)
        return f

    monkeypatch.setattr(checkpoint_writer, "open", full_open, raising=False)
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=bgfull") == 5
    err = capsys.readouterr().err
    assert one_line(err) and err.startswith("base_train: saving step 2 (writing rank_0.pt) failed: "), err
    assert "no space left on device" in err and "a checkpoint needs ~" in err and err.endswith("then --resume\n")
    assert set(names) == {"checkpoint-writer"}
    run_dir = ckpt_dir(base, "bgfull")
    assert not [d for d in os.listdir(run_dir) if d.startswith("step_")] and temporaries(run_dir) == []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        trained = [r["step"] for r in map(json.loads, f) if r["kind"] == "train"]
    assert trained == [1, 2, 3, 4]  # training went on during the write; the save at step 4 met its failure


def test_a_stop_signal_during_a_pending_write_leaves_complete_checkpoints_and_exits_143(base, monkeypatch, capsys):
    """SIGTERM arrives while step 2's write is held in the writer; the run stops at the next step, saves it and exits
    143 with both checkpoints complete and loadable, and resumes from the second."""
    handled, real_acknowledge, real_write = threading.Event(), lifecycle.acknowledge, checkpoint_writer._write
    monkeypatch.setattr(lifecycle, "acknowledge", lambda sig: handled.set() or real_acknowledge(sig))

    def write_during_a_stop(path, data):
        if "step_000002" in path and not handled.is_set():
            assert threading.current_thread().name == "checkpoint-writer"
            os.kill(os.getpid(), signal.SIGTERM)
            assert handled.wait(WAIT_S), "the main thread never handled the signal"
        real_write(path, data)

    monkeypatch.setattr(checkpoint_writer, "_write", write_during_a_stop)
    assert train(*FLAGS, "--num_iterations=50", "--model_tag=stop") == 128 + signal.SIGTERM
    steps = ckpt.list_steps("stop")
    assert len(steps) == 2 and steps[0] == 2 and temporaries(ckpt_dir(base, "stop")) == []
    assert not [d for d in os.listdir(ckpt_dir(base, "stop")) if d.endswith(".tmp")]
    for step in steps:
        ckpt.load_model("stop", str(step))
        ckpt.load_rank_state("stop", step, 0)
    assert f"stopped at step {steps[1]} by SIGTERM received" in capsys.readouterr().err
    monkeypatch.setattr(checkpoint_writer, "_write", real_write)
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=stop", "--resume") == 0
    assert f"resumed stop from step {steps[1]}" in capsys.readouterr().out
