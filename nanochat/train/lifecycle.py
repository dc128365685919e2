"""
When a run stops and when it saves, decided by every rank together.

Each rank raises flags from what only it can see: a SIGTERM/SIGINT it received, a budget its clock says is spent, a
wall-clock save that is due. Once per step the flags travel in the same all_reduce that averages the step's losses
(one collective, one host sync, both already paid for by the loss read), so every rank learns that some rank raised
a flag at the same step, and all of them save, stop or carry on together. A decision taken by one rank alone would
send it into the save barrier while the others start the next step's collectives: a deadlock.

Signals: torchrun forwards a SIGTERM/SIGINT sent to the launcher to every worker and SIGKILLs them
--shutdown-timeout seconds later (default 30); schedulers (SLURM, systemd) signal every process of the job. The run
says so at once, finishes the step or the evaluation batch in progress (evaluations check the flag after every batch,
samples after every token), saves a checkpoint and exits with 128 + the signal number. Repeats within a few
seconds (forwarded copies) count as one; a signal after that exits at once, without saving.
"""

import errno
import fcntl
import gc
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import torch

from nanochat.cli import ExitCode
from nanochat.collectives import RankFailure, raise_if_any_rank_failed, reduce_with_flags
from nanochat.cuda_allocator import configure as configure_cuda_allocator  # noqa: F401 - its old home
from nanochat.files import WriteError, writing

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# forwarded copies of one signal arrive within milliseconds; a person pressing Ctrl-C again, later
REPEAT_WINDOW_S = 5.0
FLAGS = ("signal", "budget", "save_time", "data", "write")  # data: this step's training data could not be read;
# write: rank 0 could not write the run's log, summary or a checkpoint's bpb


class StopSignals:
    """Turns SIGTERM/SIGINT into a request to save and stop (`received`), for the duration of a with-block."""

    def __init__(self):
        self.received, self.first_at, self.previous = None, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
            self.previous = {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def handle(self, signum, frame):
        if self.received is None:
            self.received, self.first_at = signal.Signals(signum), time.monotonic()
            acknowledge(self.received)
        elif time.monotonic() - self.first_at > REPEAT_WINDOW_S:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: exit now, as the default handler would
            os.kill(os.getpid(), signum)


RUN_LOCK = "run.lock"  # in the run directory; not a trace of a previous run (resume.previous_run)


class RunLockError(Exception):
    """The run directory is held by another live run, or cannot be locked; the message says what to do."""


class RunLock:
    """One run per run directory: an exclusive flock on <directory>/run.lock, taken by rank 0 before the run touches
    anything there and held until the run ends. The kernel releases it when the process dies in any way (SIGKILL
    included), so a lock is never stale; the file's text (PID, host, start time) only names the holder.

    Two stages, so a run refused by its own checks writes nothing: hold_existing() locks the lock file a previous
    run left, without writing (a live holder refuses us before we read its checkpoints); claim(), once the checks
    passed, creates the directory and the file if needed and writes this process into it. Both are collectives: every
    rank calls them and every rank raises when rank 0 could not lock."""

    def __init__(self, directory, active):
        self.directory, self.active, self.file = directory, active, None
        self.path = os.path.join(directory, RUN_LOCK)

    def hold_existing(self):
        self.agree(lambda: os.path.lexists(self.path) and self.lock(self.open_file(create=False)))

    def claim(self):
        self.agree(self.lock_and_sign)

    def release(self):
        if self.file:
            self.file.close()  # closing the last descriptor drops the flock
            self.file = None

    def agree(self, work):
        error = None
        if self.active:
            try:
                with writing(self.path):  # a full disk or a read-only directory: the one-line write failure
                    work()
            except (RunLockError, WriteError) as e:
                error = e
        try:
            raise_if_any_rank_failed(error, "locking the run directory")
        except RankFailure as failure:  # rank 0 says it in its own words; the others name rank 0 and the cause
            raise error or RunLockError(str(failure)) from None

    def open_file(self, create):
        """The lock file for reading and writing ("r+": appending would ignore the seek of lock_and_sign); never
        through a symbolic link, whose target the signature would overwrite."""
        flags = os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            file = open(self.path, "r+", opener=lambda path, mode: os.open(path, mode | flags, 0o644))
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise RunLockError(f"{self.path} is a symbolic link (to {os.readlink(self.path)!r}), not a lock file: "
                               f"remove it, then run again") from None
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            file.close()
            raise RunLockError(f"{self.path} is not a regular file: remove it, then run again")
        return file

    def lock(self, file):
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process that has not signed it yet"
            file.close()
            raise RunLockError(f"{self.directory} is in use by another run ({holder}): wait for it to end or stop it, "
                               f"or choose another --model_tag; --overwrite never moves a run in progress") from None
        self.release()  # a lock on a file that --overwrite moved aside with its directory
        self.file = file

    def lock_and_sign(self):
        os.makedirs(self.directory, exist_ok=True)
        file = self.open_file(create=True)
        if self.file and os.path.samestat(os.fstat(file.fileno()), os.fstat(self.file.fileno())):
            file.close()  # already ours: a second flock through another descriptor would wait for ourselves
        else:
            self.lock(file)
        self.file.seek(0)  # written before truncating, so a full disk leaves the previous text as it was
        self.file.write(f"PID {os.getpid()} on host {socket.gethostname()}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        self.file.flush()
        self.file.truncate()


def acknowledge(sig):
    """Say at once that a stop signal arrived (rank 0 only: every rank gets torchrun's copy). os.write, not print: the
    handler may run in the middle of another print."""
    if os.environ.get("RANK", "0") == "0":
        try:
            os.write(sys.stderr.fileno(), f"{sig.name} received: finishing the current batch, then saving\n".encode())
        except (OSError, ValueError):  # no usable stderr: the agreed stop line still follows
            pass


class RunControl:
    """The run's clock, budgets and save cadence, and the stop/save flags every rank agrees on once per step."""

    def __init__(self, max_hours, max_cost, save_every_minutes, prior_seconds, price_per_hour, signals):
        """max_hours, max_cost, save_every_minutes: the flags (None or 0: off)."""
        self.max_hours, self.max_cost, self.save_every_minutes = max_hours, max_cost, save_every_minutes
        self.prior_seconds, self.price_per_hour, self.signals = prior_seconds, price_per_hour, signals
        self.t_start = self.last_save = time.time()

    def elapsed(self):
        """Seconds of this run so far, across resumes."""
        return self.prior_seconds + time.time() - self.t_start

    def cost(self):
        return self.elapsed() / 3600 * self.price_per_hour

    def budget_spent(self):
        """The budget flag that is spent on this rank's clock, e.g. '--max_hours=2.0', or None."""
        if self.max_hours is not None and self.elapsed() >= self.max_hours * 3600:
            return f"--max_hours={self.max_hours}"
        if self.max_cost is not None and self.cost() >= self.max_cost:
            return f"--max_cost={self.max_cost}"
        return None

    def saved(self):
        self.last_save = time.time()

    def local_flags(self, data_failed, write_failed):
        minutes = self.save_every_minutes
        return [self.signals.received is not None, self.budget_spent() is not None,
                bool(minutes) and time.time() - self.last_save >= minutes * 60, data_failed, write_failed]

    def reduce(self, values, data_failed=False, write_failed=False):
        """The sum over ranks of every rank's `values` (a 1-D tensor, e.g. the step's losses) as floats, and the agreed
        flags: {'signal' | 'budget' | 'save_time' | 'data' | 'write': ranks that raised it}. One all_reduce and one
        host read; call it on every rank."""
        summed, raised = reduce_with_flags(values.float(), self.local_flags(data_failed, write_failed), to_host=True)
        return summed, dict(zip(FLAGS, raised))

    def agree(self, device):
        """The agreed flags alone, for the moment before the first step (a budget already spent, an early signal)."""
        return self.reduce(torch.zeros(0, device=device))[1]

    def stop_reason(self, flags):
        """Why the run must stop now, in words, or None. A signal wins over a budget: it has the shorter deadline."""
        if flags["signal"]:
            name = self.signals.received.name if self.signals.received else "a stop signal"
            return f"{name} received (rank {', '.join(map(str, flags['signal']))})"
        if flags["budget"]:
            spent = self.budget_spent() or " / ".join(f"--{k}={getattr(self, k)}" for k in ("max_hours", "max_cost")
                                                      if getattr(self, k) is not None)
            return f"budget spent ({spent})"
        return None

    def exit_code(self, flags):
        """0 for a run that ended as planned (the last step, a budget); 128 + signal number after a signal."""
        if not flags["signal"]:
            return ExitCode.OK
        return ExitCode.SIGNALED + (self.signals.received or signal.SIGTERM).value


class EarlyStop:
    """--early_stop=K: stop after K evaluations in a row whose final supervision step's validation bpb did not beat
    the best so far. Every rank gets the same reduced bpb, so every rank decides alike, with no collective.

    Its state travels in every checkpoint (state()), so a resumed run counts on exactly: the evaluation of the resume
    step, repeated by the resumed run, is not counted twice (last_step)."""

    def __init__(self, patience, state=None, best_recorded=None):
        """state: a checkpoint's state(); else best_recorded, (step, bpb) of the tag's best checkpoint, or None."""
        self.patience = patience
        state = state or {"best": best_recorded, "stale": 0, "last_step": None}
        self.best, self.stale, self.last_step = state["best"], state["stale"], state["last_step"]

    def state(self):
        return {"best": self.best, "stale": self.stale, "last_step": self.last_step}

    def record(self, step, bpb):
        """One evaluation's final-step bpb."""
        if self.last_step is not None and step <= self.last_step:
            return  # already counted before a resume
        self.last_step = step
        if self.best is None or bpb < self.best[1]:
            self.best, self.stale = (step, bpb), 0
        else:
            self.stale += 1

    def reason(self):
        """Why the run stops early, in words, or None."""
        if not self.patience or self.stale < self.patience:
            return None
        return (f"early stop (--early_stop={self.patience}): the validation bpb has not beaten {self.best[1]:.4f} "
                f"(step {self.best[0]}) for {self.stale} evaluation{'s' * (self.stale != 1)} in a row")


def run_child(cmd, env=None):
    """Run cmd in a session of its own and pass it every SIGINT/SIGTERM this process gets (a Ctrl-C reaches only this
    process, so the child sees each signal once and can save before it stops). Returns (exit code, the first signal
    received or None); the caller decides what each means."""
    print(f"+ {shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True, env=env)
    received = []

    def forward(signum, frame):
        received.append(signal.Signals(signum))
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, (received[0] if received else None)


GC_EVERY_STEPS = 5000


def tame_garbage_collector(first_step, step):
    """After the first step, freeze what setup left and turn automatic collection off (nanochat measured ~500 ms
    scans that free almost nothing); collect by hand every GC_EVERY_STEPS steps instead."""
    if first_step:
        gc.collect()
        gc.freeze()
        gc.disable()
    elif step % GC_EVERY_STEPS == 0:
        gc.collect()
