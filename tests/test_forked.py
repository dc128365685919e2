"""tests/support/forked.py: a child forked from the torch-preloaded server behaves as a fresh `python` would (its env,
argv, cwd, exit status, output and exit handlers), a hang is killed with its descendants, two forked ranks join one
Gloo group as torchrun's would, and nothing outlives the session."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support import forked, processes
from tests.support.helpers import ROOT

PY = sys.executable


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_child_sees_exactly_its_env_argv_cwd_and_path_before_its_module_is_imported(tmp_path):
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import os, sys
        AT_IMPORT = os.environ.get("PROBE")  # read when the module is imported, as nanochat.common's timeout is
        if __name__ == "__main__":
            print(AT_IMPORT, sorted(os.environ.items()), sys.argv[1:], os.getcwd(), sys.path[:2], sep="\\n")
    """))
    work = tmp_path / "work"
    work.mkdir()
    env = {"PROBE": "given", "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = forked.run([PY, "-m", "probe", "a", "--b=2"], 60, env=env, cwd=work)
    assert done.returncode == 0, done.stderr
    at_import, environ, argv, cwd, path = done.stdout.splitlines()
    assert at_import == "given"
    assert environ == repr(sorted(env.items()))  # nothing of this worker's environment (e.g. PYTEST_XDIST_WORKER)
    assert argv == repr(["a", "--b=2"]) and cwd == str(work)
    assert path == repr([str(work), str(tmp_path)])  # as `python -m`: the cwd first, then PYTHONPATH


@pytest.mark.parametrize("code, status, stderr", [
    ("pass", 0, ""),
    ("import sys; sys.exit(3)", 3, ""),
    ("import sys; sys.exit('bad input: say what to do')", 1, "bad input: say what to do\n"),
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM, ""),
])
def test_the_exit_status_is_pythons(code, status, stderr):
    done = forked.run([PY, "-c", code], 60, env={})
    assert done.returncode == status, done.stderr
    assert stderr in done.stderr and (stderr or done.stderr == "")
    if status == 1 and "raise" in code:  # a fresh interpreter's traceback: the command's frames, not the server's
        assert done.stderr.startswith("Traceback (most recent call last):\n  File \"<string>\", line 1"), done.stderr


def test_threads_end_atexit_runs_and_output_is_flushed_before_the_child_exits():
    code = textwrap.dedent("""
        import atexit, sys, threading, time
        atexit.register(lambda: print("atexit ran", end=""))
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
        print("unflushed", end="")
        sys.stderr.write("to stderr")
    """)
    done = forked.run([PY, "-c", code], 60, env={})
    assert (done.returncode, done.stdout, done.stderr) == (0, "unflushedthread done\natexit ran", "to stderr")


def test_one_omp_thread_as_the_tests_give_children_and_another_count_is_refused():
    done = forked.run([PY, "-c", "import torch; print(torch.get_num_threads())"], 60, env={"OMP_NUM_THREADS": "1"})
    assert done.stdout == "1\n", done.stderr
    with pytest.raises(ValueError, match="OMP_NUM_THREADS=1; a child with 2 needs a real process"):
        forked.Popen([PY, "-c", "pass"], env={"OMP_NUM_THREADS": "2"})


def test_a_signal_from_outside_reaches_the_child_and_read_until_reads_its_lines():
    # os.write, not print: a signal that lands while print's flush holds stdout's lock makes the handler's print a
    # reentrant call (RuntimeError), in any process
    code = textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b"saving\\n"), sys.exit(7)))
        os.write(1, b"ready\\n")
        time.sleep(60)
    """)
    proc = forked.Popen([PY, "-c", code], env={}, stderr=subprocess.STDOUT)
    assert processes.read_until(proc, "ready", 60) == "ready\n"
    proc.send_signal(signal.SIGTERM)
    done = processes.finish(proc, 60)
    assert (done.returncode, done.stdout) == (7, "saving\n")


def test_a_hang_is_killed_at_the_hard_timeout_with_everything_it_started():
    code = textwrap.dedent("""
        import subprocess, sys, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(grandchild.pid, flush=True)
        time.sleep(120)
    """)
    proc = forked.Popen([PY, "-c", code], env={})
    grandchild = int(proc.stdout.readline())
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="still running after 2s"):
        processes.finish(proc, 2)
    assert time.monotonic() - started < 30
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:  # reaped by its parent's end (init adopts it)
        time.sleep(0.1)
    assert not alive(grandchild)


def test_two_forked_ranks_join_one_gloo_group_as_torchruns_would():
    code = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        from nanochat.common import compute_init
        ddp, rank, local_rank, world_size, _ = compute_init("cpu")
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)
        print(f"rank {rank} of {world_size} local {local_rank} of {os.environ['LOCAL_WORLD_SIZE']}: {total.item()}")
        dist.destroy_process_group()
    """)
    done = processes.finish(forked.Ranks([PY, "-c", code], env={"PYTHONPATH": ROOT}, cwd=ROOT,
                                         stderr=subprocess.STDOUT), 120)
    assert done.returncode == 0, done.stdout
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("rank")) == [
        "rank 0 of 2 local 0 of 2: 3.0", "rank 1 of 2 local 1 of 2: 3.0"]  # both ranks in one stream


def test_a_failing_rank_gives_its_status_and_the_other_rank_is_stopped():
    code = textwrap.dedent("""
        import os, signal, sys, time
        if os.environ["RANK"] == "1":
            sys.exit(5)
        signal.signal(signal.SIGTERM, lambda *_: (print("rank 0 stopped", flush=True), sys.exit(0)))
        time.sleep(120)  # a rank waiting on a peer that is gone
    """)
    started = time.monotonic()
    done = processes.finish(forked.Ranks([PY, "-c", code], env={}, stderr=subprocess.STDOUT), 60)
    assert done.returncode == 5 and "rank 0 stopped" in done.stdout, done.stdout
    assert time.monotonic() - started < 30


def test_the_server_starts_at_the_first_fork_and_nothing_outlives_the_session(tmp_path):
    """In a process of its own: this worker's server is already running."""
    code = textwrap.dedent("""
        import multiprocessing.forkserver, sys
        from tests.support import forked
        assert multiprocessing.forkserver._forkserver._forkserver_pid is None  # importing started nothing
        proc = forked.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"], env={})
        proc.stdout.readline()
        print(proc.pid, multiprocessing.forkserver._forkserver._forkserver_pid, flush=True)
    """)
    done = processes.run([PY, "-c", code], 120, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    child, server = map(int, done.stdout.split())
    assert not alive(child) and not alive(server)
