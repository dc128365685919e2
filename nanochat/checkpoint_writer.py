"""
Checkpoints written in the background: save() blocks the step loop only while the state is copied to CPU memory
(checkpoint_manager.snapshot); a writer thread writes the files, fsyncs, renames step_N.tmp into place, and then runs
what must follow a write (the checkpoint's bpb, retention, the backup's upload), in the order they were submitted.

Every guarantee of a synchronous save holds: the files come from the same write_snapshot (atomic, fsynced, a failure
removes the .tmp); at most one write is in flight (the next save waits for the previous one); a failed write raises its
CheckpointError at the next save() or wait(), never lost; close() (at the end of a run, a stop signal or any other
way out of it) waits for the write in flight. A write in a thread, not torch.distributed.checkpoint's async_save: a
run's one-process saves are plain files, and DCP's async save needs its own process group for its collectives.
"""

import queue
import threading

from nanochat import checkpoint_manager as ckpt
from nanochat.common import distributed, print0


def can_write_in_background(model):
    """Whether this process's saves can leave the step loop: one process, unsharded. With several ranks, agreeing on a
    failed write is a collective, which must not run in a thread beside the training's own collectives."""
    from nanochat import sharding  # lazy: it loads FSDP (~1.5 s)
    return not distributed() and not sharding.is_sharded(model)


class CheckpointWriter:
    """save() and submit(work) run in one background thread, in order, when `background`; otherwise at once."""

    def __init__(self, background):
        self.background, self.error, self.jobs, self.thread = background, None, queue.Queue(), None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self.close()
            return
        try:  # the run already stops with its own error: the write in flight is still finished, and said if it failed
            self.close()
        except ckpt.CheckpointError as e:
            print0(f"WARNING: the checkpoint write in flight failed too: {e}")

    def save(self, model_tag, step, model, optimizers, meta, rank_state, rank=0, train_model=None):
        """checkpoint_manager.save_checkpoint, returning once the state is copied when in the background. Waits for
        the previous write first, and raises its CheckpointError if it failed."""
        self.wait()
        if not self.background:
            return ckpt.save_checkpoint(model_tag, step, model, optimizers, meta, rank_state, rank, train_model)
        state = ckpt.snapshot(model_tag, step, model, optimizers, meta, rank_state, rank, train_model)
        self.submit(lambda: ckpt.write_snapshot(state))
        return ckpt.step_dir(model_tag, step)

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
