"""Files that survive a crash and failures that say what to do: the base directory, atomic writes (a temporary file
beside the target, fsynced, renamed into place), the temporaries a killed writer leaves, and WriteError, the one-line
description every failed write gives; and the free space of a disk."""

import argparse
import contextlib
import errno
import glob
import io
import os
import re
import shutil
import sys

from nanochat.cli import ExitCode
from nanochat.common import describe_error, print0


def get_base_dir(create=True):
    """Where data, tokenizer, checkpoints and reports live: $NANOCHAT_BASE_DIR, default ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if create:
        with writing(base, ", or set NANOCHAT_BASE_DIR to a writable directory"):
            os.makedirs(base, exist_ok=True)
    return base


# Why a write failed, by errno, and what fixes it: the one description every failed write (outside checkpoint saves,
# which add the size they need) gives.
WRITE_FAILURES = {
    errno.ENOSPC: ("no space left on device", "free space on that disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EROFS: ("read-only file system", "remount it writable"),
    errno.EACCES: ("permission denied", "make the directory writable (chmod/chown)"),
    errno.EPERM: ("operation not permitted", "make the directory writable (chmod/chown)"),
}


class WriteError(OSError):
    """A file could not be written. The message names the file, why and what to do; entry points print it as one line
    and exit ExitCode.WRITE_FAILED. An OSError, so handlers of write failures that predate it still catch it."""
    exit_code = ExitCode.WRITE_FAILED


def write_failure(error):
    """(reason, advice) if error is a failed write, else None. Native writers (safetensors, tokenizers) raise their own
    types carrying only the system's message, so it is recognised by its wording too."""
    for code, (reason, advice) in WRITE_FAILURES.items():
        if getattr(error, "errno", None) == code or os.strerror(code) in str(error):
            return reason, advice
    if isinstance(error, OSError):  # another errno (EIO, ENAMETOOLONG, ...): the system's words
        return error.strerror or describe_error(error), "fix the cause"
    return None


def write_error(path, error, rest=""):
    """The WriteError for a failed write (write_failure(error) is not None) of path; rest: the caller's end of the
    advice (", or pick another --out", ", then resume")."""
    reason, advice = write_failure(error)
    failure = WriteError(f"cannot write {path}: {reason}; {advice}{rest}")
    failure.errno = getattr(error, "errno", None)
    return failure


@contextlib.contextmanager
def writing(path, rest=""):
    """Turn an OSError raised inside into write_error(path, ...)."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise write_error(path, e, rest) from e


@contextlib.contextmanager
def exit_on_write_error(script):
    """Around an entry point's work: a WriteError becomes one line, '<script>: <what, why, what to do>', on stderr and
    exit code ExitCode.WRITE_FAILED, no traceback."""
    try:
        yield
    except WriteError as e:
        print(f"{script}: {e}", file=sys.stderr, flush=True)
        sys.exit(ExitCode.WRITE_FAILED)


def temporary_path(path):
    """Where path is written before it is renamed into place: path.tmpPID, so a stale one names its writer."""
    return f"{path}.tmp{os.getpid()}"


def atomic_write_bytes(path, data, rest=""):
    """Write to a temporary file beside `path`, fsync, rename: a crash leaves the old file or the new one, never half.
    A failure removes the temporary file and raises WriteError; those of killed writers of path go first."""
    remove_stale_temporaries(glob.escape(path))
    tmp = temporary_path(path)
    try:
        with writing(path, rest):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(os.path.abspath(path)))
    except WriteError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save_figure(fig, path, dpi, rest=""):
    """A matplotlib figure as a PNG file, written atomically."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    atomic_write_bytes(path, png.getvalue(), rest)


def check_writable(directory):
    """Raise WriteError unless files can be created in directory (or, before it exists, in the nearest parent it will
    be made in), so a run learns it before it spends anything. A trial file, not os.access: root passes every
    permission check, and only a write meets a read-only mount as the real writes would."""
    directory = os.path.abspath(directory)
    while not os.path.isdir(directory):
        directory = os.path.dirname(directory)
    probe = temporary_path(os.path.join(directory, "write_check"))
    with writing(directory):
        with open(probe, "wb"):
            pass
        os.remove(probe)


def free_bytes(path):
    """Bytes free on the disk that holds path (or would: its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def gigabytes(n):
    """n bytes for a reader: GB from 0.1 GB, MB below."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_temporaries(*patterns):
    """Remove the temporary files and directories (NAME.tmpPID, see temporary_path) matching the glob patterns whose
    writer is dead (killed mid-write); one line says what went. A live process's are left alone."""
    removed = []
    for pattern in patterns:
        for path in sorted(glob.glob(f"{pattern}.tmp*")):
            pid = re.fullmatch(r".*\.tmp(\d+)", path)
            if pid and not process_alive(int(pid.group(1))):
                with contextlib.suppress(OSError):  # gone already, or not ours to remove: it only holds disk
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    else:
                        os.remove(path)
                    removed.append(path)
    if removed:
        print0(f"removed {len(removed)} temporary file(s) left by stopped processes: {', '.join(removed)}")
    return removed


def fsync_dir(path):
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# a tag is a directory name under checkpoints_root(), never a path: "../x" or "/x" would write or move elsewhere
MODEL_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def checkpoints_root():
    """Where every model tag's checkpoints live."""
    return os.path.join(get_base_dir(), "base_checkpoints")


def tag_problem(model_tag):
    """Why model_tag cannot name a checkpoint directory, or None."""
    if isinstance(model_tag, str) and MODEL_TAG.fullmatch(model_tag):
        return None
    return (f"model tag {model_tag!r} is not a name: use letters, digits, '.', '_' and '-' (first a letter or digit, "
            f"at most 128 characters), no '/'; checkpoints live under {checkpoints_root()}")


def model_tag_arg(value):
    """argparse type of --model_tag: a name (tag_problem)."""
    problem = tag_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def step_arg(value):
    """argparse type of --step: 'latest', 'best' or a step number (resolve_step finds it)."""
    if value in ("latest", "best") or is_step_number(value):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: use 'latest', 'best' or a step number in digits 0-9")


def is_step_number(value):
    """ASCII digits only: str.isdigit also takes '²' (which int() refuses) and other scripts' digits ('٢٠' is 20)."""
    return value.isascii() and value.isdigit()
