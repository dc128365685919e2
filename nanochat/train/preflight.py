"""
The CUDA stack checked before a launch spends money on downloads, tokenizer training and GPU hours: torch sees the
GPU, a tensor op runs on it, and a tiny torch.compile works there (Triton builds C code at run time). Each problem is
one line that names the fix; scripts/launch.py prints them and stops before anything is downloaded.
"""

import os
import re
import subprocess
import sys

from nanochat.cli import this_python

COMPILE_CHECK_TIMEOUT_S = 300  # a cold Inductor + Triton compile of one tiny kernel takes 20-60 s
TORCH_INDEX = "https://download.pytorch.org/whl"
# Run in a subprocess: a broken toolchain can hang the compile, and a timeout can end a process, not a thread.
COMPILE_SNIPPET = """
import torch
add_one = torch.compile(lambda x: x * 2 + 1)
assert add_one(torch.ones(8, device="cuda")).sum().item() == 24
torch.cuda.synchronize()
"""
# in a child process: a CUDA context made by the launcher itself would hold memory on GPU 0 for the whole run
DEVICE_OP_SNIPPET = """
import torch
torch.ones(8, device="cuda").add_(1).sum().item()
torch.cuda.synchronize()
"""
DEVICE_OP_TIMEOUT_S = 120
BUILD_TOOLS_FIX = ("Triton needs a C compiler and the Python headers: apt-get install build-essential python3-dev "
                   "(or pass --compile=false to train without compiling)")


def cuda_problems(device_type, compile_check=True):
    """One-line problems with this node's CUDA stack, each naming its fix; [] when a run can use it. Only the first
    problem is reported: the later checks need the earlier ones to pass. device_type other than cuda: []."""
    if device_type != "cuda":
        return []
    import torch  # lazy: this module must import, and report, where torch itself is broken
    if not torch.cuda.is_available():
        driver = driver_cuda_version()
        return [f"torch sees no GPU ({stack(driver)}): {stack_fix(driver)}"]
    problem = device_op_problem() or (compile_problem() if compile_check else None)
    return [problem] if problem else []


def driver_cuda_version():
    """The newest CUDA version the driver supports ('12.4', from nvidia-smi's header), or None without a driver."""
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return found.group(1) if found else None


def stack(driver):
    """'torch 2.13.0+cu128 (built for CUDA 12.8), driver for CUDA 12.4': the versions that must match, in words."""
    import torch  # lazy: this module must import, and report, where torch itself is broken
    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    supports = f"driver for CUDA {driver}" if driver else "no driver (nvidia-smi not found)"
    return f"torch {torch.__version__} ({built}), {supports}"


def version(text):
    return tuple(int(part) for part in text.split(".")[:2])


def stack_fix(driver):
    """What makes torch see the GPU: the driver, the GPUs made visible, or the torch build for the driver's CUDA."""
    import torch  # lazy: this module must import, and report, where torch itself is broken
    if driver is None:
        return "install the NVIDIA driver (nvidia-smi must work), or set DEVICE_TYPE=cpu"
    if torch.version.cuda and version(torch.version.cuda) <= version(driver):
        return ("the driver supports this build's CUDA: check that nvidia-smi lists the GPUs and CUDA_VISIBLE_DEVICES "
                "names them (after a driver update without a reboot: reboot)")
    return build_fix(driver)


def build_fix(driver):
    import torch  # lazy: this module must import, and report, where torch itself is broken
    tag = "cu" + "".join(driver.split(".")[:2]) if driver else "cuXY"
    return (f"install the torch build matching the driver, e.g. {this_python()} -m pip install "
            f"torch=={torch.__version__.split('+')[0]} "
            f"--index-url {TORCH_INDEX}/{tag} (or the newest cuXY at or below the driver's CUDA version that "
            f"{TORCH_INDEX} lists)")


def device_op_problem():
    """None when a small tensor op runs on the GPU, else why not (a build without kernels for this GPU, a driver too
    old for the build's CUDA) with the fix. Run in a child process, which takes its CUDA context with it."""
    try:
        done = subprocess.run([sys.executable, "-c", DEVICE_OP_SNIPPET], capture_output=True, text=True,
                              timeout=DEVICE_OP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        error = f"no answer in {DEVICE_OP_TIMEOUT_S} s"
    else:
        if done.returncode == 0:
            return None
        lines = done.stderr.strip().splitlines()
        error = lines[-1] if lines else f"exit code {done.returncode}"
    driver = driver_cuda_version()
    return f"a tensor op on the GPU failed ({error}; {stack(driver)}): {build_fix(driver)}"


def compile_problem(timeout=COMPILE_CHECK_TIMEOUT_S):
    """None when a tiny torch.compile runs on the GPU, else what failed and the fix."""
    try:
        # one compile thread: Inductor's worker pool would outlive a timed-out check
        done = subprocess.run([sys.executable, "-c", COMPILE_SNIPPET], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return f"a tiny torch.compile on the GPU did not finish in {timeout} s: {BUILD_TOOLS_FIX}"
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"a tiny torch.compile on the GPU failed ({lines[-1] if lines else f'exit code {done.returncode}'}): " \
               f"{BUILD_TOOLS_FIX}"
    return None


def first_line(error):
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
