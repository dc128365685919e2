"""Test children forked from a server that has already imported torch: a `python -m module` child without the ~3 CPU s
of `import torch` a fresh interpreter pays. A fork is a real separate process (its own pid, signals, exit status), so a
test whose claim is a signal from outside, a second rank or an exit code keeps it; only the repeated import goes.

The server is the standard library's multiprocessing forkserver, one per pytest worker, started at the first fork (a
worker that never forks pays nothing), with torch, numpy and pyarrow preloaded; nanochat is not preloaded, as its
modules read environment variables at import. Its children get what a fresh `python` would: exactly the env given
(os.environ replaced before the module is imported; OMP_NUM_THREADS=1 added where it lacks one, as the server has it),
the cwd, argv and sys.path of the command line, fresh stdio on pipes, and Python's exit status (SystemExit's code; 1 and
a traceback on an uncaught exception; -N when killed by signal N), with threads joined, atexit handlers run and output
flushed first. What a fork cannot give: a different OMP_NUM_THREADS (libgomp read the server's, 1, when torch loaded;
refused below), and environment variables that the preloaded libraries read at their import. A test whose claim is a
module's own `python -m` start (the interpreter's start, its imports with nothing preloaded) keeps a real process.

Popen-like objects: processes.finish, processes.read_until and processes.kill_all work on them as on subprocess.Popen.
"""

import atexit
import json
import multiprocessing.context
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing import popen_forkserver, spawn

PRELOAD = ["torch", "numpy", "pyarrow"]
SERVER_ENV = {"OMP_NUM_THREADS": "1"}  # libgomp reads it when torch loads in the server: every child has it
STDOUT, PIPE = subprocess.STDOUT, subprocess.PIPE
_POPEN = subprocess.Popen  # the real one, whatever a test later monkeypatches into the subprocess module

_lock = threading.Lock()
_context = None
_fresh_path = None  # sys.path of a fresh interpreter, less its first entry (the script's directory or the cwd)
_live = []  # what this process forked and has not seen end: killed at exit, so nothing outlives the session


def _start_server():
    """The forkserver context, its server running (started once, with torch imported under SERVER_ENV)."""
    global _context, _fresh_path
    with _lock:
        if _context is None:
            import multiprocessing
            import multiprocessing.forkserver
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            saved = {name: os.environ.get(name) for name in SERVER_ENV}
            os.environ.update(SERVER_ENV)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                for name, value in saved.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            probe = _POPEN([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"], env=clean,
                           text=True, stdout=subprocess.PIPE)
            _fresh_path = json.loads(probe.communicate(timeout=60)[0])
            atexit.register(stop)
            _context = context
    return _context


def stop():
    """Kill what is still running, then stop the server and wait for it: its CPU (and that of every child it reaped)
    then counts in this process's children, as a subprocess's does. At the session's end (tests/conftest.py) and at
    exit; again, nothing."""
    global _context
    with _lock:
        if _context is None:
            return
        from tests.support import processes
        for proc in list(_live):
            if proc.poll() is None:
                processes.kill_all(proc)
        import multiprocessing.forkserver
        multiprocessing.forkserver._forkserver._stop()
        _context = None


def server_cpu():
    """CPU seconds of the server and of the children it has reaped (a profiler adds it to this process's children;
    they are not this process's children until the server ends)."""
    import multiprocessing.forkserver
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if _context is None or pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


class _Fd:
    """A file descriptor that travels to the forked child (the forkserver passes it over its socket)."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction
        return _fd_in_child, (reduction.DupFd(self.fd),)


def _fd_in_child(dup):
    return dup.detach()


def _command(args):
    """(mode, target, argv) of a `python -m module ...`, `python -c code ...` or `python script.py ...` list."""
    args = [str(a) for a in args]
    if not args or args[0] != sys.executable or len(args) < 2:
        raise ValueError(f"forked: a command of this interpreter ({sys.executable}) is expected, got {args[:3]}")
    if args[1] in ("-m", "-c"):
        return args[1], args[2], args[3:]
    return "path", args[1], args[2:]


def _child(out, err, mode, target, argv, env, cwd, new_session, fresh_path):
    """The child's body, run in the fork: the command as a fresh interpreter would run it, then exit as it would."""
    import io
    code = 1
    try:
        err = out if err is None else err  # stderr=STDOUT
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        if new_session:
            os.setsid()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        encoding = sys.stdout.encoding
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                        encoding=encoding, write_through=unbuffered)
        sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                        encoding=encoding, errors="backslashreplace",
                                                        line_buffering=True, write_through=unbuffered)
        sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
        first = {"-m": os.getcwd(), "-c": "", "path": os.path.dirname(os.path.abspath(target))}[mode]
        sys.path[:] = [first] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + fresh_path
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()  # a fresh interpreter's global numpy stream, not the server's
        import runpy
        try:
            if mode == "-m":
                sys.argv = [target, *argv]  # run_module puts the module's file in argv[0], as -m does
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif mode == "-c":
                sys.argv = ["-c", *argv]
                import types
                main = sys.modules["__main__"] = types.ModuleType("__main__")
                exec(compile(target, "<string>", "exec"), vars(main))
            else:
                sys.argv = [target, *argv]
                runpy.run_path(target, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt as e:
            _print_traceback(e)
            code = -signal.SIGINT
        except BaseException as e:
            _print_traceback(e)
            code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        # what interpreter shutdown does before it exits: join threads, run atexit handlers, flush
        try:
            threading._shutdown()
        except BaseException:
            pass
        import atexit as child_atexit
        child_atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        if code == -signal.SIGINT:  # as Python does after an uncaught KeyboardInterrupt: die by the signal
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


def _spawn(args, env, cwd, out_w, err_w, new_session):
    """A started forkserver Process that runs args with stdout on out_w and stderr on err_w (None: on out_w)."""
    if env.get("OMP_NUM_THREADS", SERVER_ENV["OMP_NUM_THREADS"]) != SERVER_ENV["OMP_NUM_THREADS"]:
        raise ValueError(f"forked: the server's torch has OMP_NUM_THREADS={SERVER_ENV['OMP_NUM_THREADS']}; "
                         f"a child with {env['OMP_NUM_THREADS']} needs a real process")
    env = {**env, "OMP_NUM_THREADS": SERVER_ENV["OMP_NUM_THREADS"]}
    mode, target, argv = _command(args)
    _start_server()
    process = _Process(target=_child, args=(
        _Fd(out_w), _Fd(err_w) if err_w is not None else None, mode, target, argv, env,
        os.path.abspath(cwd or os.getcwd()), new_session, _fresh_path))
    process.start()
    return process


class _NoMainPopen(popen_forkserver.Popen):
    """The forkserver's Popen, less one thing: its child does not run the parent's `__main__` again (multiprocessing
    re-imports it for pickled functions of __main__; our child runs a command of its own)."""

    def _launch(self, process_obj):
        real = spawn.get_preparation_data
        spawn.get_preparation_data = lambda name: {k: v for k, v in real(name).items()
                                                   if not k.startswith("init_main_from")}
        try:
            super()._launch(process_obj)
        finally:
            spawn.get_preparation_data = real


class _Process(multiprocessing.context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _NoMainPopen(process_obj)


def _env(env):
    """The child's environment: the one given, or this process's with the server's thread count (as inherited)."""
    return dict(env) if env is not None else {**os.environ, **SERVER_ENV}


def _pipes(stdout, stderr, text):
    """(out_r, out_w, err_r, err_w): a pipe per PIPE (its read end ours), a duplicate of a file's descriptor, and for
    stderr=STDOUT no descriptor of its own (the child writes both into out_w)."""
    if not text:
        raise ValueError("forked: text=True only")

    def ends(where):
        if where == PIPE:
            return os.pipe()
        if isinstance(where, int) and where >= 0 or hasattr(where, "fileno"):
            return None, os.dup(where if isinstance(where, int) else where.fileno())
        raise ValueError(f"forked: PIPE, a file or a descriptor, not {where!r}")
    out_r, out_w = ends(stdout)
    err_r, err_w = (None, None) if stderr == STDOUT else ends(stderr)
    return out_r, out_w, err_r, err_w


def _started(envs, args, cwd, stdout, stderr, text, start_new_session=False):
    """(processes, stdout, stderr): one fork of args per env, all writing into the same pipes or files; the write ends
    closed here once the children have them, and on a failed start every child killed and the read ends closed."""
    out_r, out_w, err_r, err_w = _pipes(stdout, stderr, text)
    processes = []
    try:
        for env in envs:
            processes.append(_spawn(args, env, cwd, out_w, err_w, start_new_session))
    except BaseException:
        for process in processes:
            process.kill()
        for fd in (out_r, err_r):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w):
            if fd is not None:
                os.close(fd)
    return processes, open(out_r) if out_r is not None else None, open(err_r) if err_r is not None else None


def _print_traceback(e):
    """The traceback Python prints, from the command's own frames (this module's are not a fresh process's)."""
    import traceback
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    traceback.print_exception(type(e), e, tb)


class Popen:
    """subprocess.Popen(args, stdout=PIPE, stderr=PIPE or STDOUT, text=True, env=..., cwd=...) as a fork of the
    server: args is `[sys.executable, "-m", module, ...]` (or -c, or a script's path)."""

    def __init__(self, args, env=None, cwd=None, stdout=PIPE, stderr=PIPE, text=True, start_new_session=False,
                 kill_after=None):
        """kill_after: seconds after which the child is killed with everything it started (as `timeout -s KILL`
        would), for callers that wait on it without a hard timeout of their own."""
        self.args = [str(a) for a in args]
        (self._process,), self.stdout, self.stderr = _started([_env(env)], self.args, cwd, stdout, stderr, text,
                                                               start_new_session)
        self.pid = self._process.pid
        self.returncode = None
        self._readers = None
        _live.append(self)
        if kill_after is not None:
            timer = threading.Timer(kill_after, self._kill_tree)
            timer.daemon = True
            timer.start()

    def _kill_tree(self):
        # not poll(): the status is read by the thread that waits (two readers of one sentinel race)
        from tests.support import processes
        if self.returncode is None:
            for pid in [*processes.descendants(self.pid), self.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def poll(self):
        if self.returncode is None:
            self.returncode = self._process.exitcode
            if self.returncode is not None and self in _live:
                _live.remove(self)
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) read to their end and the exit status; TimeoutExpired leaves both to a later call."""
        if self._readers is None:  # one reader per pipe, as subprocess does on Windows: reads survive a timeout
            self._readers = []
            for stream in (self.stdout, self.stderr):
                box = []
                thread = threading.Thread(target=lambda s=stream, b=box: b.append(s.read() if s else None),
                                          daemon=True)
                thread.start()
                self._readers.append((thread, box))
        deadline = None if timeout is None else _now() + timeout
        for thread, _ in self._readers:
            thread.join(None if deadline is None else max(0, deadline - _now()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0, deadline - _now()))
        for stream in (self.stdout, self.stderr):
            if stream:
                stream.close()
        return tuple(box[0] for _, box in self._readers)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _now():
    import time
    return time.monotonic()


def run(args, timeout, **kwargs):
    """processes.run for a forked child: its CompletedProcess, killed with everything it started if it hangs."""
    from tests.support import processes
    return processes.finish(Popen(args, **kwargs), timeout)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(Popen):
    """`torchrun --standalone --nproc_per_node=N python-args` without torchrun: N forked ranks with torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; rank 0 hosts the store),
    their output in one stream as torchrun's inherited stdout gives it, and one exit status: 0 when every rank
    exits 0, else the first failing rank's (the others are then stopped, as torchrun stops them: SIGTERM, SIGKILL
    after `grace` seconds). pid is rank 0's; pids every rank's (processes.kill_all takes them all down)."""

    def __init__(self, args, nproc=2, env=None, cwd=None, stdout=PIPE, stderr=PIPE, text=True, grace=10):
        env = _env(env)
        self.args = [str(a) for a in args]
        port = free_port()
        rank_envs = [{**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                      "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                      "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"} for rank in range(nproc)]
        self._processes, self.stdout, self.stderr = _started(rank_envs, self.args, cwd, stdout, stderr, text)
        self.pid, self.pids = self._processes[0].pid, [p.pid for p in self._processes]
        self.returncode, self._readers, self._grace = None, None, grace
        self._done, self._ended = threading.Event(), set()
        threading.Thread(target=self._watch, daemon=True).start()
        _live.append(self)

    def _watch(self):
        """torchrun's monitor: the first rank to fail stops the others; the status is known when all have ended."""
        from multiprocessing.connection import wait
        failed, pending = None, list(self._processes)
        while pending:
            for sentinel in wait([p.sentinel for p in pending]):
                process = next(p for p in pending if p.sentinel == sentinel)
                process.join()
                self._ended.add(process.pid)
                pending.remove(process)
                if process.exitcode != 0 and failed is None:
                    failed = process.exitcode
                    for other in pending:
                        self._signal(other, signal.SIGTERM)
                    timer = threading.Timer(self._grace, lambda rest=list(pending): [self._signal(p, signal.SIGKILL)
                                                                                     for p in rest])
                    timer.daemon = True
                    timer.start()
        self._status = failed or 0
        self._done.set()

    def poll(self):
        if self.returncode is None and self._done.is_set():
            self.returncode = self._status
            if self in _live:
                _live.remove(self)
        return self.returncode

    def wait(self, timeout=None):
        self._done.wait(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        for process in self._processes:
            self._signal(process, sig)

    def _signal(self, process, sig):
        # not process.exitcode: only the watcher thread reads a rank's status (two readers of one sentinel race)
        if process.pid not in self._ended:
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass
