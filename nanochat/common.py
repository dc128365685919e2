"""Shared plumbing: device detection, autocast, torch.distributed setup, printing on rank 0, the peak-FLOPs table.
Collectives live in nanochat/collectives.py, files and atomic writes in nanochat/files.py."""

import contextlib
import math
import os
import random
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

# How long a rank waits in one collective before the process group gives up on its peers (NCCL's default). Work that
# rank 0 does alone while the others wait (checkpoint I/O, a backup) goes through run_on_rank0, so no single wait
# nears it. NANOCHAT_PROCESS_GROUP_TIMEOUT_S shortens it for tests.
PROCESS_GROUP_TIMEOUT = timedelta(seconds=float(os.environ.get("NANOCHAT_PROCESS_GROUP_TIMEOUT_S") or 600))
RANK0_POLL_S = min(5.0, PROCESS_GROUP_TIMEOUT.total_seconds() / 10)  # the longest one wait in run_on_rank0


def print0(*args, sep=" ", end="\n", **kwargs):
    """print on rank 0 only (flushes, so progress shows through pipes and tee), the line and its end in one write:
    unbuffered, print writes them apart, and another rank's line could land between them."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(sep.join(map(str, args)) + end, end="", **kwargs, flush=True)


# Progress in a log (stderr not a terminal): a plain line this often, none for work that ends sooner
LOG_PROGRESS_EVERY_S = 10.0


def progress_enabled():
    """Progress bars on rank 0 of a terminal only: log files and the other ranks stay free of carriage returns."""
    return get_dist_info()[1] == 0 and sys.stderr.isatty()


class LogLines:
    """tqdm's output as whole lines for a log: tqdm redraws one line on a terminal (a carriage return, padding, cursor
    moves); in a file those pile up into one unreadable line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        text = text.replace("\r", "").replace("\x1b[A", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self):
        self.stream.flush()


def progress_bar(iterable=None, **kwargs):
    """Progress of long work on rank 0 (tqdm's arguments): a bar on a terminal; in a log, a line every
    LOG_PROGRESS_EVERY_S seconds with the count and an ETA; nothing on the other ranks."""
    if get_dist_info()[1] != 0 or sys.stderr.isatty():
        return tqdm(iterable, disable=not progress_enabled(), **kwargs)
    kwargs.pop("position", None)
    total = kwargs.get("total", len(iterable) if hasattr(iterable, "__len__") else None)
    shape = "{n_fmt}/{total_fmt} {unit} ({percentage:.0f}%), {elapsed} elapsed, eta {remaining}" if total else \
        "{n_fmt} {unit}, {elapsed} elapsed, {rate_fmt}"
    return tqdm(iterable, **{**kwargs, "file": LogLines(sys.stderr), "mininterval": LOG_PROGRESS_EVERY_S,
                             "maxinterval": LOG_PROGRESS_EVERY_S, "delay": LOG_PROGRESS_EVERY_S, "miniters": 1,
                             "leave": False, "ascii": True,
                             "bar_format": "{desc}: " + shape if kwargs.get("desc") else shape})


# ---------------------------------------------------------------------------------------------------- CPU threads
BUSY_SAMPLE_S = 0.25  # how long cpu_threads watches the machine: 25 clock ticks a core, enough to see a busy process


def quota_cores(root="/sys/fs/cgroup"):
    """The cores this container's CPU quota pays for (docker --cpus=N; cgroup v2's cpu.max, or v1's cfs files), or None
    without one. Inside a container the cgroup root is the container's own; a bare host has no quota there."""
    def read(name):
        with open(os.path.join(root, name)) as f:
            return f.read().split()
    try:
        quota, period = read("cpu.max")[:2]
    except (OSError, ValueError):
        try:
            quota, period = read("cpu/cpu.cfs_quota_us")[0], read("cpu/cpu.cfs_period_us")[0]
        except (OSError, IndexError):
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return max(1, int(int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def allowed_cpus():
    """The CPU ids this process may run on: its affinity mask (taskset, a container's cpuset), else every CPU."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows have no affinity call
        return list(range(os.cpu_count() or 1))


def busy_share(cpus, seconds=BUSY_SAMPLE_S, stat="/proc/stat", sleep=time.sleep):
    """The share of `cpus` that others keep busy now, 0 to 1: their non-idle time over `seconds` while this process
    sleeps; steal (a hypervisor's other guests) counts as busy. None where /proc/stat is missing (not Linux). By hand:
    psutil reads the same counters, but it is not a dependency, for ten lines."""
    def read():
        total = idle = 0
        with open(stat) as f:
            for line in f:
                name, *fields = line.split()
                if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
                    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    total, idle = total + sum(values), idle + values[3] + values[4]
        return total, idle
    try:
        (total0, idle0), _, (total1, idle1) = read(), sleep(seconds), read()
    except (OSError, ValueError):
        return None
    return 1 - (idle1 - idle0) / (total1 - total0) if total1 > total0 else 0.0


def free_threads(cap, busy):
    """Threads for the cores nobody else uses, of `cap`, when a share `busy` of them is taken: an OpenMP region waits
    for its slowest thread, so one thread that shares a core with a busy process stalls the others (dev/LOG.md, issue
    58). A core counts as taken from half busy on; never fewer than 1."""
    return cap if busy is None else max(1, cap - math.floor(busy * cap + 0.5))


def cpu_threads(requested=None, share=None):
    """(torch's thread count for this process, why), by precedence: `requested` (a --threads flag), OMP_NUM_THREADS when
    the user set it (torch has read it already), else torch's default (the physical cores) bounded by the cores this
    process may use (affinity, container quota) and lowered by those that others keep busy now (free_threads)."""
    if requested:
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS"
    cpus, quota = allowed_cpus(), quota_cores()
    cap = min(torch.get_num_threads(), len(cpus), quota or len(cpus))
    why = f"{len(cpus)} core{'s' * (len(cpus) > 1)} allowed" + (f", a quota of {quota}" if quota else "")
    busy = (share or busy_share)(cpus) if cap > 1 else None  # one thread: nothing to lower, nothing to watch
    if busy is None:
        return cap, why
    return free_threads(cap, busy), f"{why}, {100 * busy:.0f}% busy with other work"


def use_cpu_threads(requested=None):
    """Set torch's thread count by cpu_threads; returns the one line that says it (printed by the caller)."""
    threads, why = cpu_threads(requested)
    torch.set_num_threads(threads)
    return f"CPU threads: {threads} ({why}; --threads=N or OMP_NUM_THREADS=N sets it)"


def autodetect_device_type():
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def device_available(device_type):
    return device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available()) or (
        device_type == "mps" and torch.backends.mps.is_available())


def is_ddp():
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def get_dist_info():
    """(ddp, rank, local_rank, world_size) from torchrun's environment; a plain process is rank 0 of 1."""
    if is_ddp():
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def compute_init(device_type=None, seed=42):
    """Pick the device, seed, and join the process group when launched by torchrun (NCCL on CUDA, Gloo otherwise).

    Returns (ddp, rank, local_rank, world_size, device).
    """
    device_type = device_type or autodetect_device_type()
    if not device_available(device_type):
        raise ValueError(f"device_type={device_type!r} is not available on this machine "
                         f"(found {autodetect_device_type()!r}); pass --device_type={autodetect_device_type()}")
    torch.manual_seed(seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(seed)
        torch.set_float32_matmul_precision("high")
    ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if ddp and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", timeout=PROCESS_GROUP_TIMEOUT,
                                device_id=device if device_type == "cuda" else None)
        dist.barrier()
    return ddp, rank, local_rank, world_size, device


def compute_cleanup(together=False):
    """Tear the process group down; together: every rank got here together (the end of a run), so wait for the
    others first, since a rank that destroys Gloo while a peer still talks to it can abort (SIGABRT) at exit."""
    if distributed():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def distributed():
    return dist.is_available() and dist.is_initialized()


def rng_state():
    """Every generator's state as tensors and plain data: numpy's key array as a list, so that rank files load with
    weights_only=True."""
    name, keys, *rest = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, keys.tolist(), *rest), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    """Put rng_state's generators back (a checkpoint's, on resume)."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]  # keys: a list, or an ndarray in rank files written before lists
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"].cpu())  # torch only takes CPU byte tensors, whatever the run's device
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def describe_error(error):
    return f"{type(error).__name__}: {error}"


# Dense bf16 Tensor Core peak FLOP/s (no sparsity: the datasheets' "with sparsity" figures are twice these), keyed
# by the full device name torch.cuda.get_device_name reports: variants of one GPU differ in clocks and power, so
# "NVIDIA H100 PCIe" must not match the SXM part. Sources: NVIDIA H100 Tensor Core GPU datasheet (SXM 989, PCIe 756,
# NVL 835), H200 Tensor Core GPU datasheet (SXM 989, NVL 835), DGX/HGX B200 datasheet (B200 2250), GB200 NVL72
# datasheet (2500 per GPU), A100 Tensor Core GPU datasheet (312, every form factor), L40S datasheet (362), AWS EC2
# G5 instance specifications (A10G 70), GeForce RTX 4090 (Ada) and RTX 3090 (Ampere) whitepapers (165, 71), GH200
# Grace Hopper Superchip datasheet (989, the H100 SXM's, every memory variant), H800 datasheets (SXM 989, PCIe 756).
GPU_PEAK_BF16_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,  # SXM5
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA GH200 480GB": 989e12,  # 96 GB HBM3 (480 GB is the Grace memory beside it)
    "NVIDIA GH200 120GB": 989e12,
    "NVIDIA GH200 144G HBM3e": 989e12,
    "NVIDIA H800": 989e12,  # SXM
    "NVIDIA H800 80GB HBM3": 989e12,  # SXM
    "NVIDIA H800 PCIe": 756e12,
    "NVIDIA H200": 989e12,  # SXM
    "NVIDIA H200 NVL": 835e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA GB200": 2500e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA L40S": 362e12,
    "NVIDIA A10G": 70e12,
    "NVIDIA GeForce RTX 4090": 165e12,
    "NVIDIA GeForce RTX 3090": 71e12,
}


def gpu_peak_flops(device_name):
    """Peak dense bf16 FLOP/s of a device named exactly as torch.cuda.get_device_name reports it (e.g. 'NVIDIA H100
    80GB HBM3'), or None when the name is not in the table (a CPU, an unlisted GPU): then MFU is not shown."""
    return GPU_PEAK_BF16_FLOPS.get(device_name.strip())


def default_dtype(device_type):
    """The autocast dtype when --dtype is not given: bfloat16 where it is fast (CUDA), float32 elsewhere."""
    return "bfloat16" if device_type == "cuda" else "float32"


def autocast_for(device_type, dtype):
    """The context a forward runs in: bf16 autocast, or nothing for float32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
