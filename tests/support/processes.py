"""Processes a test starts: every one gets a hard timeout, and on a hang it is killed with everything it started."""

import os
import selectors
import signal
import subprocess
import time

import pytest


def descendants(pid):
    """Every process below pid (torchrun starts its workers in sessions of their own, so a group kill misses them)."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    stack, out = [pid], []
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def kill_all(proc):
    """proc and everything below it (every rank of a forked.Ranks: its pids)."""
    roots = getattr(proc, "pids", [proc.pid])
    for pid in [pid for root in roots for pid in [*descendants(root), root]]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def finish(proc, timeout):
    """proc's subprocess.CompletedProcess; one still running after timeout seconds is killed with everything it
    started, and the test fails."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"hung: {' '.join(map(str, proc.args))[:200]} still running after {timeout}s:\n"
                    f"{(stdout or '')[-2000:]}\n{(stderr or '')[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(cmd, timeout, **kwargs):
    """subprocess.run(cmd, capture_output=True, text=True) with a hard timeout that takes the process tree down."""
    return finish(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs), timeout)


def read_until(proc, prefix, timeout):
    """proc's output up to and including its first line starting with prefix (proc: stdout=PIPE, text=True)."""
    lines, deadline = [], time.time() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.time() < deadline:
            if sel.select(timeout=1):
                line = proc.stdout.readline()
                if not line:
                    break
                lines.append(line)
                if line.startswith(prefix):
                    return "".join(lines)
    kill_all(proc)
    pytest.fail(f"no line starting with {prefix!r} within {timeout}s:\n{''.join(lines)[-3000:]}")
