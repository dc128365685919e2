"""A copy of a tag's checkpoints at any fsspec URL (--backup_dir), uploaded from a background thread so that training
never waits for it, and pulled back by --resume when the local directory is empty."""

import json
import math
import os
import posixpath
import shutil
import threading

import fsspec

from nanochat.checkpoint.manager import CheckpointError, step_dir
from nanochat.checkpoint.meta import final_val_bpb, steps_to_prune
from nanochat.cli import this_python
from nanochat.common import describe_error, print0

BACKUP_EXIT_WAIT_S = 600  # how long a finished run waits for an upload still in flight


class Backup:
    """A copy of the tag's checkpoints at an fsspec URL (gs://, s3://, a local path, memory://).

    start() runs a background thread: submit(step) after each completed local save queues that checkpoint (a newer
    one replaces one still waiting), which is uploaded with meta.json last (a step counts as backed up only once its
    meta.json is there), then retention is applied to the backup too. A failure warns; training never waits."""

    def __init__(self, fs, directory, url, model_tag, keep_last=0):
        self.fs, self.dir, self.url, self.model_tag, self.keep_last = fs, directory, url, model_tag, keep_last
        self.pending, self.busy, self.closed = None, False, False
        self.cond = threading.Condition()
        self.thread = None

    @classmethod
    def location(cls, url, model_tag, keep_last=0):
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except Exception as e:  # noqa: BLE001 - an unknown protocol, a missing filesystem package, bad options
            raise CheckpointError(f"--backup_dir={url}: {describe_error(e)} (gs:// needs `{this_python()} -m pip "
                                  f"install gcsfs`, s3:// needs s3fs)") from e
        return cls(fs, posixpath.join(root.rstrip("/") or "/", model_tag), url, model_tag, keep_last)

    def remote(self, step, name=""):
        return posixpath.join(self.dir, f"step_{step:06d}", name)

    def steps(self):
        """Steps with a complete copy in the backup, ascending."""
        try:
            paths = self.fs.glob(posixpath.join(self.dir, "step_*", "meta.json"))
        except Exception as e:  # noqa: BLE001 - no access, no network
            raise CheckpointError(f"cannot list the backup {self.url}: {describe_error(e)}") from e
        names = [posixpath.basename(posixpath.dirname(p)) for p in paths]
        return sorted(int(n[5:]) for n in names if n[5:].isdigit())

    def restore(self, which="latest"):
        """Download one checkpoint (the newest, or step `which`) into the local tag directory; returns its step."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"the backup {self.url} holds no checkpoint of {self.model_tag!r}")
        step = steps[-1] if which in (None, "latest") else int(which)
        if step not in steps:
            raise CheckpointError(f"the backup {self.url} has no step {step} of {self.model_tag!r}; it has {steps}")
        final, tmp = step_dir(self.model_tag, step), step_dir(self.model_tag, step) + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for path in self.fs.ls(self.remote(step), detail=False):
            self.fs.get_file(path, os.path.join(tmp, posixpath.basename(path)))
        os.rename(tmp, final)
        print0(f"restored {self.model_tag} step {step} from the backup {self.url}")
        return step

    def start(self):
        self.closed = False
        self.thread = threading.Thread(target=self.work, name="checkpoint-backup", daemon=True)
        self.thread.start()
        return self

    def submit(self, step):
        with self.cond:
            self.pending = step
            self.cond.notify_all()

    def work(self):
        while True:
            with self.cond:
                while self.pending is None and not self.closed:
                    self.cond.wait()
                if self.pending is None:
                    return
                step, self.pending, self.busy = self.pending, None, True
            try:
                self.upload(step)
                self.prune()
                print0(f"backup: step {step} copied to {self.url}")
            except Exception as e:  # noqa: BLE001 - a backup failure must never stop training
                print0(f"WARNING: backup of step {step} to {self.url} failed ({describe_error(e)}); training goes "
                       f"on and the local checkpoint is complete")
            finally:
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()

    def upload(self, step):
        local = step_dir(self.model_tag, step)
        names = sorted(os.listdir(local), key=lambda name: name == "meta.json")  # meta.json last: marks it complete
        if self.fs.exists(self.remote(step, "meta.json")):  # a re-saved step: never "complete" while half-copied
            self.fs.rm(self.remote(step, "meta.json"))
        self.fs.makedirs(self.remote(step), exist_ok=True)
        for name in names:
            self.fs.put_file(os.path.join(local, name), self.remote(step, name))

    def remote_bpb(self, step):
        """The final-step validation bpb a backed-up meta.json records, or None where it records no number: a damaged
        or altered remote file neither stops retention nor passes for the best step."""
        try:
            bpb = final_val_bpb(json.loads(self.fs.cat_file(self.remote(step, "meta.json"))))
        except (ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError):  # not JSON, a dict, ...
            return None
        return bpb if type(bpb) in (int, float) and math.isfinite(bpb) else None

    def prune(self):
        bpb = {s: self.remote_bpb(s) for s in self.steps()}
        for s in steps_to_prune(bpb, self.keep_last):
            self.fs.rm(self.remote(s), recursive=True)

    def close(self, timeout=BACKUP_EXIT_WAIT_S):
        """Wait, at most timeout seconds, for an upload in flight or waiting, then end the thread. On rank 0 of a
        distributed run, call it through collectives.run_on_rank0, so the other ranks wait without nearing the
        process-group timeout."""
        with self.cond:
            if self.pending is not None or self.busy:
                print0(f"waiting (at most {timeout:.0f}s) for the backup to {self.url} to finish")
            self.closed = True
            self.cond.notify_all()
        self.thread.join(timeout)
        if self.thread.is_alive():
            print0(f"WARNING: the backup to {self.url} did not finish in {timeout:.0f}s; exiting without it (the local "
                   f"checkpoints are complete)")
