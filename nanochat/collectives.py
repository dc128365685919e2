"""Collectives every rank takes part in, so that ranks decide together: a sum that also says which ranks raised a
flag (stop, skip, fail), an error on any rank raised on every rank, and work rank 0 does alone while the others wait
without nearing the process-group timeout. Each takes group=: a process group of all ranks other than the default,
so that a thread (the checkpoint writer) can decide together with its peers beside the training's own collectives."""

import threading

import torch
import torch.distributed as dist

from nanochat.common import RANK0_POLL_S, describe_error, distributed


def run_on_rank0(work, rank, group=None):
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
        _, (finished,) = reduce_with_flags(torch.zeros(0, device=collective_device(group)),
                                           [worker is not None and not worker.is_alive()], group=group)
        if finished:
            return error[0] if error else None


def collective_device(group=None):
    """Where small control tensors must live for the process group's backend (NCCL only moves GPU tensors)."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


def reduce_with_flags(values, flags, to_host=False, group=None):
    """Sum `values` (a 1-D tensor) over ranks and learn which ranks raised each of `flags` (bools), in one all_reduce
    and one host read.

    Returns (summed values, [ranks that raised flag i, for each i]); every rank gets the same answer, so decisions
    made from it (stop, save, skip) are taken by all ranks together. Without a process group: this rank's own.
    to_host: the summed values as a list of floats, read together with the flags.
    """
    if not distributed():
        return (values.tolist() if to_host else values), [[0] if flag else [] for flag in flags]
    world, rank, n = dist.get_world_size(group), dist.get_rank(group), values.numel()
    raised = torch.zeros(len(flags), world, dtype=values.dtype, device=values.device)
    for i, flag in enumerate(flags):
        if flag:
            raised[i, rank] = 1.0  # a fill on the device: no copy from pageable host memory, so no sync
    payload = torch.cat([values.flatten(), raised.flatten()])
    dist.all_reduce(payload, group=group)
    host = payload.tolist() if to_host else payload[n:].tolist()
    summed, raised = (host[:n], host[n:]) if to_host else (payload[:n].view_as(values), host)
    return summed, [[r for r in range(world) if raised[i * world + r]] for i in range(len(flags))]


class RankFailure(RuntimeError):
    """Something failed on one or more ranks; every rank raises it, so none is left waiting in a collective."""


def raise_if_any_rank_failed(error, what, failed=None, group=None):
    """Every rank calls this with its own error (an exception, or None). If any rank failed, every rank raises
    RankFailure('<what> failed on rank R: <cause>'); otherwise it returns. A collective: call it on every rank.
    failed: the failing ranks when the caller already reduced them (reduce_with_flags), saving the all_reduce."""
    if not distributed():
        if error is not None:
            raise RankFailure(f"{what} failed: {describe_error(error)}") from error
        return
    if failed is None:
        _, (failed,) = reduce_with_flags(torch.zeros(0, device=collective_device(group)), [error is not None],
                                         group=group)
    if not failed:
        return
    causes = [None] * dist.get_world_size(group)  # gathered only on failure: the common path stays one all_reduce
    dist.all_gather_object(causes, None if error is None else describe_error(error), group=group)
    raise RankFailure(f"{what} failed " + "; ".join(f"on rank {r}: {causes[r]}" for r in failed))


# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single (the old names now warn); older torch,
# the GPU machine's 2.11 and many cloud images, has only the old ones. Looked up at each call, so tests can hide one.
def reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, async_op=False):
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, op=op, async_op=async_op)


def all_gather_single(output, input, async_op=False):
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, input, async_op=async_op)


_ALL_TO_ALL = {"native": True}


def all_to_all(recv, send):
    """dist.all_to_all; where the backend has none (Gloo before torch 2.13: CPU runs on an older torch), every rank
    gathers every rank's sends and keeps the parts addressed to it: world-size times the traffic, CPU only. Gloo
    refuses at the call, on every rank alike, before anything is sent, so the fallback is taken by all together."""
    if _ALL_TO_ALL["native"]:
        try:
            return dist.all_to_all(recv, send)
        except RuntimeError as e:
            if "does not support alltoall" not in str(e):
                raise
            _ALL_TO_ALL["native"] = False
    stacked = torch.stack(send)
    gathered = [torch.empty_like(stacked) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stacked)
    rank = dist.get_rank()
    for source, parts in enumerate(gathered):
        recv[source].copy_(parts[rank])
