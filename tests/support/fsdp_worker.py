"""
FSDP training against one process, for tests/test_fsdp.py. Launched as
`torchrun --standalone --nproc_per_node=2 tests/support/fsdp_worker.py MODE ARGS`, one of

    train CONFIG DETACH COMPILE OUT   # 2 ranks
    muon OUT                          # ShardedMuon vs Muon
    memory OUT                        # each rank's peak bytes
    gathers CONFIG OUT                # all-gathers and FSDP roots per micro-step
    syncs CONFIG OUT                  # host syncs per step
    dtypes OUT                        # blocks' input dtypes
    metainit OUT                      # the weights of a model initialised sharded
    buildmemory OUT                   # host memory a sharded build takes
    ci OUT_DIR                        # every CI case, one launch: OUT_DIR/<case>.pt, or <case>.err.<rank> if it raised

`train`: base_train's step (forward_backward per micro-batch, reduce_gradients, the norm summed over ranks,
clipped_step) on a model sharded by nanochat.train.sharding; rank r trains on batch r. run_single (called by the test in
its own process) trains the unsharded model on both batches with 2 accumulation steps: the same effective batch.
"""

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.compile import compile_regions
from nanochat.train.optim import clipped_step, reduce_gradients, setup_optimizers

STEPS = 5
GRAD_CLIP = 0.5
# a fixed depth and the one-step detach (a backward per supervision step, what FSDP's one iteration must survive):
# the steps a worker trains are the steps the plan counts
FIXED = dict(sample_n_sup=False, backprop_steps=1)
CONFIGS = {  # a plain transformer, and the recursion with a prelude and a coda block
    "plain": dict(sequence_len=16, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=32, n_loops=0,
                  n_sup_train=1, **FIXED),
    "trm": dict(sequence_len=16, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=32, n_loops=1,
                T_recursion=2, n_sup_train=3, n_prelude=1, n_coda=1, **FIXED),
}
CONFIGS["trm-checkpointing"] = {**CONFIGS["trm"], "activation_checkpointing": True}  # backward re-gathers in recompute
CONFIGS["trm-one-sweep"] = {**CONFIGS["trm"], "T_recursion": 1}
# rows 5 and 1 don't divide 2 ranks (1 leaves rank 1 an empty shard); three (6, 10) matrices: an odd group
MUON_SHAPES = [(6, 10), (5, 3), (6, 10), (1, 4), (6, 10), (5, 3)]


def build(config, detach):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIGS[config], detach_between_steps=detach))
    model.init_weights()
    with torch.no_grad():  # the zero-initialised projections drawn: every weight gets a gradient from step 0
        for p in model.parameters():
            if not p.any():
                p.normal_(std=1.0 / math.sqrt(p.size(-1)))
    return model


def batch(data_rank, step):
    g = torch.Generator().manual_seed(100 * step + data_rank)
    return torch.randint(0, 64, (2, 2, 16), generator=g).unbind(0)


def train(model, optimizers, data_ranks, distributed):
    """STEPS steps; returns every step's (mean loss over the data ranks, gradient norm)."""
    history = []
    for step in range(STEPS):
        loss = sum(model.forward_backward(*batch(r, step), loss_scale=1 / len(data_ranks))[0]
                   for r in data_ranks) / len(data_ranks)
        sq_norm = reduce_gradients(optimizers)
        if distributed:
            both = torch.stack([loss / dist.get_world_size(), sq_norm])
            dist.all_reduce(both)
            loss, sq_norm = both
        clipped_step(optimizers, sq_norm.sqrt().item(), GRAD_CLIP)
        model.zero_grad(set_to_none=True)
        history.append((loss.item(), sq_norm.sqrt().item()))
    return history


def run_single(config, detach):
    model = build(config, detach)
    return train(model, setup_optimizers(model, weight_decay=0.1), [0, 1], distributed=False), model.state_dict()


def run_sharded(config, detach, compile_visits=False):
    from nanochat.train import sharding
    model = sharding.shard_model(build(config, detach), torch.device("cpu"))
    if compile_visits:  # base_train --compile: the layer visit (inside Block.visit, FSDP's forward method)
        compile_regions(model, "layer")
    optimizers = sharding.on_shards(setup_optimizers(model, weight_decay=0.1))
    history = train(model, optimizers, [dist.get_rank()], distributed=True)
    return history, {k: v.full_tensor() for k, v in model.state_dict().items()}


def muon_on_shards():
    """ShardedMuon on FSDP-sharded toy matrices, 3 steps of random gradients; the whole matrices after each step."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from nanochat.train import sharding
    from nanochat.train.optim import Muon
    params = toy_matrices()
    holder = torch.nn.ParameterList(params)
    fully_shard(holder)
    sharded = list(holder.parameters())
    opt = sharding.on_shards([Muon(sharded, lr=0.02, momentum=0.95, weight_decay=0.1)])[0]
    out = []
    for step in range(3):
        for p, g in zip(sharded, toy_grads(step)):
            p.grad = distribute_tensor(g, p.device_mesh, p.placements)
        opt.step(grad_scale=0.7)
        out.append([p.full_tensor().clone() for p in sharded])
    return out


MEMORY_CONFIG = dict(sequence_len=32, vocab_size=2048, n_layer=4, n_head=2, n_kv_head=2, n_embd=256, n_loops=1,
                     n_sup_train=2, sample_n_sup=False)  # the depth it trains is the depth the estimate plans
MEMORY_BATCH = 2


def measured_peak():
    """Peak bytes of this rank's live CPU tensors over two sharded training steps, from the profiler's allocation
    events, the model built and sharded inside the profiled region (tests/test_memory.py's method). Gloo's threads
    free some buffers where the profiler does not see it (its "Total Allocated" then grows by every step's gathers),
    so an address handed out again counts as freed first; a buffer freed unseen and never reused stays counted."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from nanochat.train import sharding
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**MEMORY_CONFIG))
        model.init_weights()
        sharding.shard_model(model, torch.device("cpu"))
        optimizers = sharding.on_shards(setup_optimizers(model))
        idx = torch.randint(0, MEMORY_CONFIG["vocab_size"], (MEMORY_BATCH, MEMORY_CONFIG["sequence_len"]))
        for _ in range(2):
            model.forward_backward(idx, idx)
            sq_norm = reduce_gradients(optimizers)
            dist.all_reduce(sq_norm)
            clipped_step(optimizers, sq_norm.sqrt().item(), 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            events = sorted((e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"),
                            key=lambda e: e["ts"])
    live, total, peak = {}, 0, 0
    for e in events:
        total -= live.pop(e["args"]["Addr"], 0)
        if e["args"]["Bytes"] > 0:
            live[e["args"]["Addr"]] = e["args"]["Bytes"]
            total += e["args"]["Bytes"]
        peak = max(peak, total)
    return peak


def gathers_per_micro_step(config):
    """Parameter all-gathers (FSDP calls torch.distributed.all_gather_single) in one forward_backward, after a first,
    the FSDP iteration roots it starts (FSDP's "FSDP::root_pre_forward" profiler ranges: a block call that becomes a
    root orders its gather after all the compute queued before it), and whether a gathered buffer outlives it (the
    last forward gather's, which only the root's end of iteration frees)."""
    from torch.profiler import ProfilerActivity, profile

    from nanochat.train import sharding
    model = sharding.shard_model(build(config, detach=True), torch.device("cpu"))
    model.forward_backward(*batch(dist.get_rank(), 0))  # FSDP's lazy initialisation happens in the first
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"  # torch < 2.13
    real, calls = getattr(dist, name), []
    setattr(dist, name, lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.forward_backward(*batch(dist.get_rank(), 1))
    finally:
        setattr(dist, name, real)
    held = model._get_fsdp_state()._comm_ctx.all_gather_state is not None
    return len(calls), sum(event.name == "FSDP::root_pre_forward" for event in prof.events()), held


def syncs_per_step(config):
    """Host syncs (tests.support.helpers.host_syncs) in base_train's step on the sharded model, after a first step,
    apart from the one read of the step's norm: forward_backward, reduce_gradients and the optimizers (ShardedMuon,
    AdamW)."""
    from nanochat.train import sharding
    from tests.support.helpers import host_syncs
    model = sharding.shard_model(build(config, detach=True), torch.device("cpu"))
    optimizers = sharding.on_shards(setup_optimizers(model, weight_decay=0.1))
    counts = []
    for step in range(2):
        with host_syncs() as counted:
            model.forward_backward(*batch(dist.get_rank(), step))
            sq_norm = reduce_gradients(optimizers)
            dist.all_reduce(sq_norm)
        norm = sq_norm.sqrt().item()  # the step's one read (base_train's reduction), not counted
        with host_syncs() as stepped:
            clipped_step(optimizers, norm, GRAD_CLIP)
        model.zero_grad(set_to_none=True)
        counts.append(len(counted) + len(stepped))
    return counts[-1]


def block_input_dtypes(sharded):
    """The dtype of every block call's input in one bf16-autocast micro-step of "trm", sharded with bf16 weights (as
    on GPUs) or not (as under DDP), in call order."""
    from nanochat.model.gpt import Block
    from nanochat.train import sharding
    seen, delta, forward = [], Block.delta, Block.forward
    Block.delta = lambda self, u, *a, **k: seen.append(str(u.dtype)) or delta(self, u, *a, **k)
    Block.forward = lambda self, u, *a, **k: seen.append(str(u.dtype)) or forward(self, u, *a, **k)
    try:
        model = build("trm", detach=True)
        if sharded:
            sharding.shard_model(model, torch.device("cpu"), param_dtype=torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.forward_backward(*batch(dist.get_rank(), 0))
    finally:
        Block.delta, Block.forward = delta, forward
    return seen


# 65 vocabulary rows and the halting head's 1 don't divide 2 ranks (FSDP pads; rank 1 holds none of the head); the
# decay update gives every recursive block its retain_y and retain_z
META_CONFIG = dict(sequence_len=16, vocab_size=65, n_layer=2, n_head=2, n_kv_head=1, n_embd=32, n_loops=1,
                   state_update="decay", halt_head=True, n_prelude=1, n_coda=1)


def meta_initialised():
    """The model sharding.build_sharded_model initialises from seed 0: its state dict gathered (full_tensor), its
    parameters as FSDP gathers them for compute (unshard: what forward reads), each rank's shard shapes, and its
    rotary tables."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from nanochat.train import sharding
    torch.manual_seed(0)
    model = sharding.build_sharded_model(GPTConfig(**META_CONFIG).to_dict(), torch.device("cpu"))
    shards = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items()}
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    gathered = {k: v.detach().clone() for k, v in model.named_parameters() if not isinstance(v, DTensor)}
    for unit in units:
        unit.reshard()
    return {"state": state, "gathered": gathered, "shards": shards, "cos": model.cos, "sin": model.sin}


BUILD_MEMORY_CONFIG = dict(sequence_len=64, vocab_size=8192, n_layer=8, n_head=4, n_kv_head=4, n_embd=512)


def host_bytes(field):
    """This process's VmRSS (resident now) or VmHWM (the peak resident so far) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def build_memory():
    """How much this rank's resident host memory peaks above where it was while base_train's build_model builds the
    sharded model (~134 MB float32) on the CPU, after a tiny build has paid the one-off costs (FSDP's and DTensor's
    first use, the device mesh); with the model's bytes and this rank's shards'."""
    from nanochat.trainer import build_model
    tiny = dict(sequence_len=8, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=8)
    build_model(GPTConfig(**tiny).to_dict(), torch.device("cpu"), True, "float32")
    torch.manual_seed(0)
    with open("/proc/self/clear_refs", "w") as f:  # the peak so far (imports, earlier cases) reset to what is resident
        f.write("5")
    start = host_bytes("VmRSS")
    model = build_model(GPTConfig(**BUILD_MEMORY_CONFIG).to_dict(), torch.device("cpu"), True, "float32")
    growth = host_bytes("VmHWM") - start
    params = list(model.parameters())
    return {"growth": growth, "model": sum(p.numel() * p.element_size() for p in params),
            "shards": sum(p.to_local().numel() * p.element_size() for p in params)}


def toy_matrices():
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in MUON_SHAPES]


def toy_grads(step):
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(s, generator=g) for s in MUON_SHAPES]


def everywhere(case):
    """case() run on every rank, its results gathered: [rank 0's, rank 1's, ...]."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, case())
    return out


# mode -> (the arguments after the mode, without OUT; the function of them whose result rank 0 saves)
MODES = {
    "metainit": (0, meta_initialised),
    "buildmemory": (0, lambda: everywhere(build_memory)),
    "dtypes": (0, lambda: {"fsdp": block_input_dtypes(sharded=True), "ddp": block_input_dtypes(sharded=False)}),
    "syncs": (1, lambda config: everywhere(lambda: syncs_per_step(config))),
    "gathers": (1, gathers_per_micro_step),
    "memory": (0, lambda: everywhere(measured_peak)),
    "muon": (0, muon_on_shards),
    "train": (3, lambda config, detach, compiled: dict(zip(("history", "state"), run_sharded(
        config, detach == "1", compiled == "1")))),
}
# What tests/test_fsdp.py runs in CI, as (mode, arguments): one torchrun for all of them, since starting one (a Python
# and torch per process) costs more than most cases; buildmemory first, before the others grow the heap
CI_CASES = [("buildmemory", []), ("metainit", []), ("muon", []), ("memory", []), ("dtypes", []), ("syncs", ["trm"]),
            ("gathers", ["trm"]), ("train", ["trm", "0", "0"]), ("train", ["trm", "1", "0"])]


def case_name(mode, args):
    return "-".join([mode, *map(str, args)])


def run_case(mode, args, out):
    result = MODES[mode][1](*args)
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()


def run_ci_cases(out_dir):
    """Every CI case; one that raises leaves its traceback in <case>.err for its test, and the next goes on (a case
    raises on every rank alike here: one rank raising alone would leave the other in a collective, and the test's
    hard timeout ends the launch)."""
    import traceback
    for mode, args in CI_CASES:
        name, t0 = case_name(mode, args), time.time()
        try:
            run_case(mode, args, os.path.join(out_dir, f"{name}.pt"))
            print(f"rank {dist.get_rank()}: {name} {time.time() - t0:.1f}s", flush=True)  # where a slow launch goes
        except Exception:  # noqa: BLE001 - reported to the case's test, whatever it is
            with open(os.path.join(out_dir, f"{name}.err.{dist.get_rank()}"), "w") as f:
                f.write(traceback.format_exc())


if __name__ == "__main__":
    dist.init_process_group("gloo")
    mode = sys.argv[1]
    if mode == "ci":
        run_ci_cases(sys.argv[2])
    else:
        count = MODES[mode][0]
        run_case(mode, sys.argv[2:2 + count], sys.argv[2 + count])
    dist.barrier()  # every rank here before any tears Gloo down: one that goes first can abort a peer still in it
    dist.destroy_process_group()
    # the results are saved: skip the interpreter's C++ teardown, where about one run of tests/test_fsdp.py in five
    # aborted ("terminate called without an active exception"; cause not found, see dev/LOG.md)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
