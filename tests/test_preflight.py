"""The launch's checks of the CUDA stack (each failure through stand-ins for torch.cuda, nvidia-smi and the compile
subprocess: one line with the fix) and multi-node preparation (node 0 prepares the shared base directory, the other
nodes wait for its marker or give up at a deadline with one line)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from nanochat.train import multinode, preflight
from scripts import launch
from tests.support import forked
from tests.support.helpers import OVERRIDES, launcher_in_process

PIP_FIX = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu124"
BUILD_FIX = "apt-get install build-essential python3-dev"


@pytest.fixture
def cuda_build(monkeypatch):
    """torch 2.13.0 built for CUDA 12.8 on a node whose driver supports CUDA 12.4."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(preflight, "driver_cuda_version", lambda: "12.4")


@pytest.fixture
def working_gpu(monkeypatch):
    """A GPU where tensor ops work: 'cuda' tensors are made on the CPU."""
    real_ones = torch.ones
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch, "ones", lambda *shape, device=None: real_ones(*shape))


def compile_subprocess(monkeypatch, returncode=0, stderr="", hang=False, op_stderr=None):
    """Stand-in for the checks' subprocesses (the tensor op's passes unless op_stderr; the compile's as asked);
    returns the commands of the compile checks it was asked to run."""
    calls = []

    def fake_run(cmd, timeout=None, **kwargs):
        if cmd[-1] == preflight.DEVICE_OP_SNIPPET:
            return subprocess.CompletedProcess(cmd, 1 if op_stderr else 0, "", op_stderr or "")
        calls.append(cmd)
        if hang:
            raise subprocess.TimeoutExpired(cmd, timeout)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)
    monkeypatch.setattr(preflight.subprocess, "run", fake_run)
    return calls


def test_cpu_runs_touch_nothing_of_cuda(monkeypatch):
    def untouchable(*args, **kwargs):
        raise AssertionError("touched CUDA or started a process")
    monkeypatch.setattr(torch.cuda, "is_available", untouchable)
    monkeypatch.setattr(preflight.subprocess, "run", untouchable)
    assert preflight.cuda_problems("cpu") == []


def test_a_build_for_a_newer_cuda_than_the_driver_names_both_and_the_matching_build(monkeypatch, cuda_build):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = compile_subprocess(monkeypatch)
    [line] = preflight.cuda_problems("cuda")
    assert "torch 2.13.0+cu128 (built for CUDA 12.8), driver for CUDA 12.4" in line and PIP_FIX in line
    assert calls == []  # later checks need a GPU


def test_a_cpu_only_build_says_so(monkeypatch, cuda_build):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [line] = preflight.cuda_problems("cuda")
    assert "a CPU-only build" in line and PIP_FIX in line


def test_no_driver_says_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [line] = preflight.cuda_problems("cuda")
    assert "no driver (nvidia-smi not found)" in line and "install the NVIDIA driver" in line


def test_a_driver_new_enough_for_the_build_points_at_visibility_not_a_reinstall(monkeypatch, cuda_build):
    monkeypatch.setattr(preflight, "driver_cuda_version", lambda: "12.10")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [line] = preflight.cuda_problems("cuda")
    assert "driver for CUDA 12.10" in line and "CUDA_VISIBLE_DEVICES" in line and "pip install" not in line


def test_the_driver_cuda_version_is_read_from_nvidia_smi(monkeypatch, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4     |'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert preflight.driver_cuda_version() == "12.4"


def test_a_failing_tensor_op_names_the_error_and_the_build_fix(monkeypatch, cuda_build, working_gpu):
    calls = compile_subprocess(monkeypatch, op_stderr="Traceback ...\nmore detail\ntorch.AcceleratorError: CUDA "
                                                       "error: no kernel image is available for execution\n")
    [line] = preflight.cuda_problems("cuda")
    assert "AcceleratorError: CUDA error: no kernel image is available" in line and PIP_FIX in line
    assert "more detail" not in line and calls == []


def test_the_launcher_makes_no_cuda_context_of_its_own(monkeypatch, cuda_build):
    """The tensor op runs in a child process: a context in the launcher would hold GPU 0's memory all run long."""
    def untouchable(*args, **kwargs):
        raise AssertionError("a tensor was made on the GPU in the launcher's process")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "ones", untouchable)
    compile_subprocess(monkeypatch)
    assert preflight.cuda_problems("cuda") == []


def test_a_failing_compile_names_the_build_tools(monkeypatch, cuda_build, working_gpu):
    compile_subprocess(monkeypatch, returncode=1, stderr="Traceback ...\nInductorError: fatal error: Python.h: No "
                                                         "such file or directory\n")
    [line] = preflight.cuda_problems("cuda")
    assert "Python.h: No such file or directory" in line and BUILD_FIX in line and "\n" not in line


def test_a_hanging_compile_is_cut_off_with_the_fix(monkeypatch, cuda_build, working_gpu):
    compile_subprocess(monkeypatch, hang=True)
    [line] = preflight.cuda_problems("cuda")
    assert f"did not finish in {preflight.COMPILE_CHECK_TIMEOUT_S} s" in line and BUILD_FIX in line


def test_the_compile_check_really_stops_a_hung_subprocess(monkeypatch):
    monkeypatch.setattr(preflight, "COMPILE_SNIPPET", "import time; time.sleep(60)")
    t0 = time.monotonic()
    assert "did not finish in 1 s" in preflight.compile_problem(timeout=1)
    assert time.monotonic() - t0 < 10


def test_a_working_stack_passes_and_dry_run_skips_the_compile(monkeypatch, cuda_build, working_gpu):
    calls = compile_subprocess(monkeypatch)
    assert preflight.cuda_problems("cuda") == [] and len(calls) == 1
    assert preflight.cuda_problems("cuda", compile_check=False) == [] and len(calls) == 1


def test_this_machine_without_a_gpu_gets_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    [line] = preflight.cuda_problems("cuda")
    assert "sees no GPU" in line


# ---------------------------------------------------------------------------------------------------- the launcher
@pytest.fixture
def launch_env(tmp_path, monkeypatch):
    """scripts.launch in process on an 8xH100 node (stand-in), with the commands it would run recorded."""
    return launcher_in_process(monkeypatch, tmp_path, "NVIDIA H100 80GB HBM3")


def test_the_launcher_stops_on_a_cuda_problem_before_any_download(launch_env, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(preflight, "cuda_problems", lambda device, compile_check: asked.append(compile_check) or
                        ["a tiny torch.compile on the GPU failed (x): " + BUILD_FIX])
    assert launch.main(["train", "8xH100", "fast"]) == 2 and launch_env == [] and asked == [True]
    err = capsys.readouterr().err
    assert "preflight failed, nothing was run or downloaded" in err and BUILD_FIX in err
    monkeypatch.setenv("DRY_RUN", "1")
    assert launch.main(["train", "8xH100", "fast"]) == 0 and asked == [True, False]
    out = capsys.readouterr().out
    assert f"PREFLIGHT    a tiny torch.compile on the GPU failed (x): {BUILD_FIX}" in out
    assert "the preflight above would stop a real run" in out


def test_a_second_node_waits_for_node_0_then_starts_torchrun(launch_env, monkeypatch, tmp_path):
    monkeypatch.setattr(preflight, "cuda_problems", lambda device, compile_check: [])
    monkeypatch.setattr(multinode, "POLL_S", 0.05)
    for name, value in {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", multinode.WAIT_ENV: "1"}.items():
        monkeypatch.setenv(name, value)
    assert launch.main(["train", "8xH100", "fast"]) == 1 and launch_env == []  # no marker: gave up, ran nothing
    (tmp_path / multinode.READY_MARKER).write_text(json.dumps({"dataset": "fineweb", "shards": 50}))
    launch.main(["train", "8xH100", "fast"])
    assert [cmd[0] for cmd in launch_env] == ["torchrun"]  # no download, no tokenizer: node 0 made them


def test_node_0_prepares_then_marks_and_clears_an_old_marker_first(launch_env, monkeypatch, tmp_path):
    monkeypatch.setattr(preflight, "cuda_problems", lambda device, compile_check: [])
    for name, value in {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "10.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    marker = tmp_path / multinode.READY_MARKER
    marker.write_text(json.dumps({"dataset": "fineweb", "shards": 50}))
    seen = []
    monkeypatch.setattr(launch, "run", lambda cmd: seen.append((cmd[:3], marker.exists())))
    launch.main(["train", "8xH100", "fast"])
    assert seen == [([sys.executable, "-m", "nanochat.data.dataset"], False),
                    ([sys.executable, "-m", "scripts.tok_train"], False),
                    (["torchrun", "--nnodes=2", "--node_rank=0"], True)]
    assert json.loads(marker.read_text()) == {"dataset": "fineweb", "shards": 50}


# ---------------------------------------------------------------------------------------------------- multinode
def test_the_wait_ends_when_node_0_marks_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    prepared = {"dataset": "fineweb", "shards": 3}
    node0 = threading.Timer(0.3, lambda: multinode.prepare_on_node0(lambda: None, prepared, 2, 0, 60))
    node0.start()
    t0 = time.monotonic()
    assert multinode.prepare_on_node0(lambda: pytest.fail("node 1 prepared"), prepared, 2, 1, 30, poll_s=0.05) is None
    assert 0.3 <= time.monotonic() - t0 < 10
    node0.join()


def test_the_wait_gives_up_at_the_deadline_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    (tmp_path / multinode.READY_MARKER).write_text(json.dumps({"dataset": "fineweb", "shards": 50}))  # another phase
    line = multinode.wait_for_node0({"dataset": "fineweb", "shards": 100}, 1, 0.2, poll_s=0.05)
    assert "\n" not in line and "node 1 waited 0.2 s" in line and "but found one for {'dataset': 'fineweb', " \
                                                                   "'shards': 50}" in line
    assert "NANOCHAT_BASE_DIR must be a directory shared by every node" in line and multinode.WAIT_ENV in line
    t0 = time.monotonic()  # a poll longer than the deadline ends at the deadline, not a poll later
    assert "node 1 waited 0.2 s" in multinode.wait_for_node0({"dataset": "fineweb", "shards": 100}, 1, 0.2, poll_s=60)
    assert time.monotonic() - t0 < 10


def test_a_single_node_prepares_without_a_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    done = []
    assert multinode.prepare_on_node0(lambda: done.append(1), {"shards": 1}, 1, 0, 1) is None
    assert done == [1] and not os.path.exists(tmp_path / multinode.READY_MARKER)


def test_a_second_node_that_never_sees_the_marker_exits_nonzero(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    env.update(NANOCHAT_BASE_DIR=str(tmp_path), NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", DEVICE_TYPE="cpu",
               NPROC="1", FORCE="1", OMP_NUM_THREADS="1", **{multinode.WAIT_ENV: "1"})
    done = forked.run([sys.executable, "-m", "scripts.launch", "train", "8xH100", "fast", "--depth=2"],
                      timeout=120, cwd=launch.__file__.rsplit("/scripts/", 1)[0], env=env)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("launch: node 1 waited 1 s for node 0's")


def test_a_node_whose_base_dir_is_not_node_0s_stops_within_the_probe_not_the_deadline(tmp_path):
    """Two directories on one machine stand for two nodes that do not share NANOCHAT_BASE_DIR."""
    node0_dir, node1_dir = tmp_path / "node0", tmp_path / "node1"
    node0_dir.mkdir(), node1_dir.mkdir()
    prepared = {"dataset": "fineweb", "shards": 3}
    node0 = threading.Thread(target=multinode.prepare_on_node0, args=(lambda: time.sleep(2), prepared, 2, 0, 60),
                             kwargs=dict(poll_s=0.05, base_dir=str(node0_dir)))
    node0.start()
    t0 = time.monotonic()
    line = multinode.prepare_on_node0(lambda: pytest.fail("node 1 prepared"), prepared, 2, 1, 60, poll_s=0.05,
                                      probe_s=0.5, base_dir=str(node1_dir))
    assert 0.5 <= time.monotonic() - t0 < 5 and "\n" not in line
    assert f"node 1 saw no sign of node 0 in {node1_dir} within 0.5 s" in line and multinode.PROBE_ENV in line
    node0.join()
    # the same two nodes sharing one directory: node 1 sees the beat, outlasts the probe and starts with node 0
    node0 = threading.Thread(target=multinode.prepare_on_node0, args=(lambda: time.sleep(1.5), prepared, 2, 0, 60),
                             kwargs=dict(poll_s=0.05, base_dir=str(node0_dir)))
    node0.start()
    assert multinode.prepare_on_node0(None, prepared, 2, 1, 60, poll_s=0.05, probe_s=0.5,
                                      base_dir=str(node0_dir)) is None
    node0.join()


def test_a_node_stops_when_node_0s_heartbeat_stops_without_a_marker(tmp_path):
    with multinode.Heartbeat(str(tmp_path), beat_s=0.05):  # node 0 prepares ...
        time.sleep(0.2)
        t0 = time.monotonic()
        waiter = threading.Thread(target=lambda: result.append(multinode.wait_for_node0(
            {"shards": 1}, 1, 60, poll_s=0.05, probe_s=5, base_dir=str(tmp_path))))
        result = []
        waiter.start()
        time.sleep(0.3)
    waiter.join(timeout=10)  # ... and dies: no marker will come
    assert "node 0's heartbeat" in result[0] and "stopped" in result[0] and time.monotonic() - t0 < 5
