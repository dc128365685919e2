"""
Writing a checkpoint: snapshot() copies a rank's state to CPU memory, write_snapshot() writes it into step_N.tmp,
fsyncs and renames it into place, every rank agreeing on a failure (save_checkpoint does both at once). Where the
files live and how they are read back is checkpoint_manager's.

Checkpoints written in the background: save() blocks the step loop only while the state is copied to CPU memory
(snapshot); a writer thread writes the files, fsyncs, renames step_N.tmp into place, and then runs
what must follow a write (the checkpoint's bpb, retention, the backup's upload), in the order they were submitted.

Every guarantee of a synchronous save holds: the files come from the same write_snapshot (atomic, fsynced, a failure
removes the .tmp); at most one write is in flight (the next save waits for the previous one); a failed write raises its
CheckpointError at the next save() or wait(), never lost; close() (at the end of a run, a stop signal or any other
way out of it) waits for the write in flight. With several ranks the thread agrees on a failure in a Gloo process group
of its own, so its collectives never interleave with the training's on the default group. A write in a thread, not
torch.distributed.checkpoint's async_save: an unsharded run's saves are plain files; sharded runs save with DCP on the
default group, before training goes on.
"""

import errno
import json
import os
import queue
import shutil
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save as safetensors_bytes

from nanochat.checkpoint.manager import (
    SHARD_INDEX,
    TRAIN_WEIGHTS,
    WEIGHTS,
    CheckpointError,
    checkpoint_bytes,
    model_dir,
    step_dir,
)
from nanochat.collectives import RankFailure, raise_if_any_rank_failed, run_on_rank0
from nanochat.common import PROCESS_GROUP_TIMEOUT, distributed, print0, rng_state
from nanochat.files import free_bytes, fsync_dir, gigabytes


def _write(path, data):
    """Write bytes or a torch object, flushed to the disk before the directory is renamed into place."""
    with open(path, "wb") as f:
        if isinstance(data, bytes):
            f.write(data)
        else:
            torch.save(data, f)
        f.flush()
        os.fsync(f.fileno())


def _out_of_space(error, directory, need):
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left" in str(error) \
        or free_bytes(directory) < need


def host_copy(value):
    """value with every tensor copied into CPU memory and every dict, list and tuple rebuilt: a snapshot that the
    training's next steps cannot change."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return value


@dataclass
class Snapshot:
    """What one rank's checkpoint files will hold, in CPU memory: weights by file name, the rank file, meta.json."""
    model_tag: str
    step: int
    rank: int
    need: int  # bytes a checkpoint takes, for the full-disk advice
    weights: dict
    rank_file: dict
    meta: bytes


def snapshot(model_tag, step, model, optimizers, meta, rank_state, rank=0, train_model=None, sharded=False):
    """The state save_checkpoint writes, copied to CPU memory. Sharded: only the rank file and meta.json (DCP
    writes the weights and optimizer state)."""
    modules = {} if sharded else {WEIGHTS: model, TRAIN_WEIGHTS: train_model}
    weights = {name: {k: v.contiguous() for k, v in host_copy(module.state_dict()).items()}
               for name, module in modules.items() if module is not None}
    rank_file = {"rng": rng_state(), **rank_state} if sharded else \
        {"optimizers": [opt.state_dict() for opt in optimizers], "rng": rng_state(), **rank_state}
    return Snapshot(model_tag, step, rank, checkpoint_bytes(model), weights, host_copy(rank_file),
                    json.dumps({**meta, "step": step}, indent=2).encode())


def save_checkpoint(model_tag, step, model, optimizers, meta, rank_state, rank=0, train_model=None):
    """Every rank calls this. rank_state: this rank's dataloader state (and anything else per-rank). model: the
    weights to publish (those evaluated and sampled); train_model: the weights training goes on from, when they
    differ (an EMA is published).

    A failure on any rank removes the partial save and raises CheckpointError on every rank; a full disk says so,
    with the bytes a checkpoint needs."""
    from nanochat.train import sharding  # lazy: it loads FSDP (~1.5 s); sampling and serving need not
    sharded = sharding.is_sharded(model)
    state = snapshot(model_tag, step, model, optimizers, meta, rank_state, rank, train_model, sharded)
    shards = (lambda tmp: write_shards(tmp, model, train_model, optimizers)) if sharded else None
    return write_snapshot(state, shards)


def write_snapshot(state, shards=None, group=None):
    """Write a snapshot into step_N.tmp, fsynced, then rename it into place; shards(tmp): the sharded weights' writer,
    a collective. Every rank calls this; a failure on any rank removes the partial save and raises CheckpointError on
    every rank. group: the process group the ranks agree in (the writer thread's own; None: the default)."""
    model_tag, step, rank, need = state.model_tag, state.step, state.rank, state.need
    final, tmp = step_dir(model_tag, step), step_dir(model_tag, step) + ".tmp"

    def together(what, work, rank0_only=False):
        if rank0_only:  # the others wait in short collectives: writing the weights may outlast the group's timeout
            error = run_on_rank0(work, rank, group)
        else:
            error = None
            try:
                work()
            except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
                error = e
        if error is not None and _out_of_space(error, model_dir(model_tag), need):
            error = OSError(errno.ENOSPC, "no space left on device")
        try:
            raise_if_any_rank_failed(error, f"saving step {step} ({what})", group=group)
        except RankFailure as failure:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            advice = (f"; a checkpoint needs ~{gigabytes(need)} ({need:,} bytes), "
                      f"{gigabytes(free_bytes(model_dir(model_tag)))} are free: free space, lower --keep_last or set "
                      f"NANOCHAT_BASE_DIR to a bigger disk, then --resume"
                      if "no space left" in str(failure) else "; fix the cause, then --resume")
            raise CheckpointError(f"{failure}. The partial save was removed and earlier checkpoints are intact"
                                  f"{advice}") from failure

    def prepare():
        if rank == 0:
            os.makedirs(model_dir(model_tag), exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a process killed mid-save
            os.makedirs(tmp)

    def publish():
        for name, weights in state.weights.items():
            _write(os.path.join(tmp, name), safetensors_bytes(weights))
        _write(os.path.join(tmp, "meta.json"), state.meta)
        fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. after resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(model_dir(model_tag))

    rank_file = os.path.join(tmp, f"rank_{rank}.pt")
    together("preparing the directory", prepare)
    together(f"writing {os.path.basename(rank_file)}", lambda: _write(rank_file, state.rank_file))
    if shards:
        together("writing the shards", lambda: shards(tmp))
    together("writing the model and meta.json", publish, rank0_only=True)
    return final


def write_shards(directory, model, train_model, optimizers):
    """Every rank writes its shards of the weights and optimizer state (and rank 0 the index, .metadata)."""
    import torch.distributed.checkpoint as dcp  # lazy: DCP costs ~1 s to import, paid only by sharded runs

    from nanochat.train import sharding  # lazy: it loads FSDP (~1.5 s); sampling and serving need not
    dcp.save(sharding.checkpoint_state(model, train_model, optimizers), checkpoint_id=directory)
    for name in os.listdir(directory):  # DCP flushes but does not fsync: the rename must find them on the disk
        if name.endswith(".distcp") or name == SHARD_INDEX:
            with open(os.path.join(directory, name), "rb") as f:
                os.fsync(f.fileno())


def can_write_in_background(model):
    """Whether this process's saves can leave the step loop: unsharded (DCP's sharded save takes collectives on the
    default group, which must not run in a thread beside the training's own)."""
    from nanochat.train import sharding  # lazy: it loads FSDP (~1.5 s)
    return not sharding.is_sharded(model)


class CheckpointWriter:
    """save() and submit(work) run in one background thread, in order, when `background`; otherwise at once."""

    def __init__(self, background):
        """Every rank constructs it at the same point: with several ranks, a background writer makes its own group."""
        self.background, self.error, self.jobs, self.thread = background, None, queue.Queue(), None
        # Gloo whatever the training's backend: the agreement is a few bytes, and a CPU group needs no CUDA stream
        self.group = dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT) if background and distributed() \
            else None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
            return
        try:  # the run already stops with its own error: the write in flight is still finished, and said if it failed
            self.close()
        except CheckpointError as e:
            print0(f"WARNING: the checkpoint write in flight failed too: {e}")

    def save(self, model_tag, step, model, optimizers, meta, rank_state, rank=0, train_model=None):
        """save_checkpoint, returning once the state is copied when in the background. Waits for
        the previous write first, and raises its CheckpointError if it failed."""
        self.wait()
        if not self.background:
            return save_checkpoint(model_tag, step, model, optimizers, meta, rank_state, rank, train_model)
        state = snapshot(model_tag, step, model, optimizers, meta, rank_state, rank, train_model)
        self.submit(lambda: write_snapshot(state, group=self.group))
        return step_dir(model_tag, step)

    def submit(self, work):
        """work() after the writes and work submitted before it; skipped once one of them failed."""
        if not self.background:
            work()
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self.work, name="checkpoint-writer", daemon=True)
            self.thread.start()
        self.jobs.put(work)

    def work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                self.jobs.task_done()
                return
            self.run(job)
            del job  # the snapshot it holds is freed now, not when the next job arrives

    def run(self, job):
        try:
            if self.error is None:
                job()
        except Exception as e:  # noqa: BLE001 - kept for the main thread: wait() raises it there
            self.error = e
        finally:
            self.jobs.task_done()

    def wait(self):
        """Block until everything submitted is done; raise the first failure among it."""
        self.jobs.join()
        error, self.error = self.error, None
        if error is not None:
            try:
                raise error
            finally:
                error = None  # no cycle through this frame: it would keep the run's frames (its lock) alive

    def close(self):
        """wait(), and end the thread."""
        try:
            self.wait()
        finally:
            if self.thread is not None:
                self.jobs.put(None)
                self.thread.join()
                self.thread = None
