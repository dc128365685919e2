"""Shared plumbing: device detection, torch.distributed setup, printing, the base directory."""

import contextlib
import errno
import glob
import io
import os
import re
import shutil
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from nanochat.cli import ExitCode

# How long a rank waits in one collective before the process group gives up on its peers (NCCL's default). Work that
# rank 0 does alone while the others wait (checkpoint I/O, a backup) goes through run_on_rank0, so no single wait
# nears it. NANOCHAT_PROCESS_GROUP_TIMEOUT_S shortens it for tests.
PROCESS_GROUP_TIMEOUT = timedelta(seconds=float(os.environ.get("NANOCHAT_PROCESS_GROUP_TIMEOUT_S") or 600))
RANK0_POLL_S = min(5.0, PROCESS_GROUP_TIMEOUT.total_seconds() / 10)  # the longest one wait in run_on_rank0


def print0(*args, **kwargs):
    """print on rank 0 only (flushes, so progress shows through pipes and tee)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def progress_enabled():
    """Progress bars on rank 0 of a terminal only: log files and the other ranks stay free of carriage returns."""
    return get_dist_info()[1] == 0 and sys.stderr.isatty()


def progress_bar(iterable=None, **kwargs):
    """A tqdm bar that shows only where progress_enabled()."""
    from tqdm import tqdm
    return tqdm(iterable, disable=not progress_enabled(), **kwargs)


def get_base_dir(create=True):
    """Where data, tokenizer, checkpoints and reports live: $NANOCHAT_BASE_DIR, default ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if create:
        with writing(base, ", or set NANOCHAT_BASE_DIR to a writable directory"):
            os.makedirs(base, exist_ok=True)
    return base


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


def run_on_rank0(work, rank):
    """work() on rank 0 while every other rank waits for it; returns rank 0's exception (None elsewhere, or when it
    succeeded), for raise_if_any_rank_failed. A collective: call it on every rank.

    The others wait in short collectives, one every RANK0_POLL_S seconds until rank 0's work is done, rather than in
    one long one: however long rank 0 works (a download, an upload, a large file), no wait nears the process-group
    timeout, so no rank gives up on a peer that is only busy."""
    error = []

    def attempt():
        try:
            work()
        except Exception as e:  # noqa: BLE001 - handed to the caller, which tells every rank
            error.append(e)

    if not distributed():
        if rank == 0:
            attempt()
        return error[0] if error else None
    worker = threading.Thread(target=attempt, name="rank0-work", daemon=True) if rank == 0 else None
    if worker:
        worker.start()
    while True:
        if worker:
            worker.join(RANK0_POLL_S)
        _, (finished,) = reduce_with_flags(torch.zeros(0, device=collective_device()),
                                           [worker is not None and not worker.is_alive()])
        if finished:
            return error[0] if error else None


def distributed():
    return dist.is_available() and dist.is_initialized()


def collective_device():
    """Where small control tensors must live for the process group's backend (NCCL only moves GPU tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def reduce_with_flags(values, flags, to_host=False):
    """Sum `values` (a 1-D tensor) over ranks and learn which ranks raised each of `flags` (bools), in one all_reduce
    and one host read.

    Returns (summed values, [ranks that raised flag i, for each i]); every rank gets the same answer, so decisions
    made from it (stop, save, skip) are taken by all ranks together. Without a process group: this rank's own.
    to_host: the summed values as a list of floats, read together with the flags.
    """
    if not distributed():
        return (values.tolist() if to_host else values), [[0] if flag else [] for flag in flags]
    world, rank, n = dist.get_world_size(), dist.get_rank(), values.numel()
    raised = torch.zeros(len(flags), world, dtype=values.dtype, device=values.device)
    for i, flag in enumerate(flags):
        if flag:
            raised[i, rank] = 1.0  # a fill on the device: no copy from pageable host memory, so no sync
    payload = torch.cat([values.flatten(), raised.flatten()])
    dist.all_reduce(payload)
    host = payload.tolist() if to_host else payload[n:].tolist()
    summed, raised = (host[:n], host[n:]) if to_host else (payload[:n].view_as(values), host)
    return summed, [[r for r in range(world) if raised[i * world + r]] for i in range(len(flags))]


class RankFailure(RuntimeError):
    """Something failed on one or more ranks; every rank raises it, so none is left waiting in a collective."""


def raise_if_any_rank_failed(error, what, failed=None):
    """Every rank calls this with its own error (an exception, or None). If any rank failed, every rank raises
    RankFailure('<what> failed on rank R: <cause>'); otherwise it returns. A collective: call it on every rank.
    failed: the failing ranks when the caller already reduced them (reduce_with_flags), saving the all_reduce."""
    if not distributed():
        if error is not None:
            raise RankFailure(f"{what} failed: {describe_error(error)}") from error
        return
    if failed is None:
        _, (failed,) = reduce_with_flags(torch.zeros(0, device=collective_device()), [error is not None])
    if not failed:
        return
    causes = [None] * dist.get_world_size()  # gathered only on failure: the common path stays one all_reduce
    dist.all_gather_object(causes, None if error is None else describe_error(error))
    raise RankFailure(f"{what} failed " + "; ".join(f"on rank {r}: {causes[r]}" for r in failed))


def describe_error(error):
    return f"{type(error).__name__}: {error}"


# Why a write failed, by errno, and what fixes it: the one description every failed write (outside checkpoint saves,
# which add the size they need) gives.
WRITE_FAILURES = {
    errno.ENOSPC: ("no space left on device", "free space on that disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EROFS: ("read-only file system", "remount it writable"),
    errno.EACCES: ("permission denied", "make the directory writable (chmod/chown)"),
    errno.EPERM: ("operation not permitted", "make the directory writable (chmod/chown)"),
}
WRITE_FAILED = ExitCode.WRITE_FAILED  # the name the writers and base_train use


class WriteError(OSError):
    """A file could not be written. The message names the file, why and what to do; entry points print it as one line
    and exit WRITE_FAILED. An OSError, so handlers of write failures that predate it still catch it."""
    exit_code = WRITE_FAILED


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
    exit code WRITE_FAILED, no traceback."""
    try:
        yield
    except WriteError as e:
        print(f"{script}: {e}", file=sys.stderr, flush=True)
        sys.exit(WRITE_FAILED)


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
