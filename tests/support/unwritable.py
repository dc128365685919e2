"""Writes that fail as on a full disk or a read-only file system, for the tests of what every entry point says then.

Monkeypatched, so they fail the same way for root (whom chmod does not stop) and for anyone else; test_write_failures
also meets a real full and read-only tmpfs where the tests run as root."""

import builtins
import errno
import glob
import os
import re
import subprocess

FULL, READ_ONLY = errno.ENOSPC, errno.EROFS


class FullDiskFile:
    """A file opened on a full disk: it exists (0 bytes), and every write fails."""

    def __init__(self, file):
        self.file = file

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def fail_writes(monkeypatch, under, code, name=""):
    """From now on, opening for writing a file in the directory `under` (at any depth) whose name starts with `name`
    fails as it would with errno `code`: FULL creates the file and fails its writes, READ_ONLY fails the open."""
    real_open = builtins.open
    under = os.path.abspath(under) + os.sep

    def fake_open(file, mode="r", *args, **kwargs):
        path = os.path.abspath(file) if isinstance(file, (str, os.PathLike)) else ""
        if path.startswith(under) and os.path.basename(path).startswith(name) and set(mode) & set("wax+"):
            if code != FULL:
                raise OSError(code, os.strerror(code), path)
            return FullDiskFile(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)


def temporaries(directory):
    """The NAME.tmpPID files and directories under directory, at any depth."""
    return [p for p in glob.glob(os.path.join(directory, "**", "*"), recursive=True) if re.search(r"\.tmp\d+$", p)]


def dead_pid():
    """The PID of a process that has exited (what a killed writer leaves in its temporary file's name)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def one_line(text):
    """text is exactly one line (and no traceback)."""
    return text.count("\n") == 1 and "Traceback" not in text
