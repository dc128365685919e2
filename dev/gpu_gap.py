"""
Where our GPU step loses to nanochat HEAD's (issue 52), part by part: forward+backward and the optimizer timed apart,
ours and HEAD's alike (a device sync before, between and after: the same three a step), the median of 10 steps after
2 warm-up steps (the first compiles); then one profiled step's top kernels and the SDPA op that ran, and the peak
memory. One H100 runs the whole list in about 5 minutes; the JSON and the table are rewritten after every variant, so
a timeout keeps what finished, and --budget_s starts no variant past it.

    bash dev/gpu_carry.sh --model-only ~/src/nanochat      # here: .gpu_carry/nanochat = HEAD's five model files
    timeout 360 python3 -m dev.gpu_gap --nanochat .gpu_carry/nanochat --out $OUT/gap     # there (torch 2.11)
    python -m dev.gpu_gap --device cpu --size toy --backend aot_eager --nanochat DIR --out DIR   # the plumbing

The variants, most telling first (plain = depth 12, n_loops 0, one supervision step, batch 32 x 2048, vocab 65,536;
bf16 autocast; base_train's update: the norm read once, clipped at 1.0):

  plain_layer_16         ours as the kits ran it: the layer visit compiled, the head in 16 chunks of 4,096 rows, the
                         state diagnostics measured
  head_native            nanochat HEAD as it trains itself: no autocast (its bf16 compute dtype: a bf16 residual,
                         bf16 embedding), the whole model compiled, its fused MuonAdamW (no clipping)
  plain_model_1          ours compiled whole (--compile_scope=model) with one full-batch fused head, no diagnostics
                         (a step between --diagnostics_every's): the new plain default where memory allows
  plain_model_2          the same in 2 head chunks (what the plan takes on 80 GB by today's estimate)
  plain_layer_4          the layer visit, 4 head chunks
  plain_layer_1          the layer visit, one head chunk
  plain_layer_16_nodiag  as plain_layer_16 without the diagnostics
  plain_model_1_bf16     plain_model_1 with a bf16 residual (--state_dtype=bfloat16)
  head_autocast          HEAD under bf16 autocast, as the kits ran it
  trm_fp32               the default TRM at the planner's batch, as base_train runs it now (the layer visit, the
                         planned head, no diagnostics)
  trm_bf16               the same with the recursion state in bf16 (--state_dtype=bfloat16)
  trm_holding            issue 57's recipe (sample_n_sup=lognormal_poisson, backprop_steps=4: 4 supervision steps'
                         activations alive) at the planner's batch and its recompute-or-accumulate choice, timed at
                         n_sup_train steps; the bar: >= 45% MFU
  trm_holding_recompute  the same with every layer visit recomputed, at the largest batch that then fits: the other
                         side of the plan's choice (planned_time in both says what the plan expected)
  trm_detached           the detached recipe before issue 57 (sample_n_sup=False, backprop_steps=1) at its planner's
                         batch

    timeout 300 python3 -m dev.gpu_gap --variants trm_holding,trm_holding_recompute,trm_detached --out $OUT/gap

Every variant records: fwd_bwd_s, optimizer_s, step_s (medians), tok/s, MFU (the step's), peak and estimated memory,
syncs per timed step, host reads in the optimizer, the top kernels by device time, the SDPA ops that ran; HEAD's
variants also whether HEAD loaded FlashAttention 3 (flash_attention.HAS_FA3 / USE_FA3) and its compute dtype.
Outputs: --out/gap.json and --out/gap.md.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: base_train's allocator settings

# isort: split
import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import sys
import time
import types

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dev.bench_train_step import other_nanochat
from dev.gpu_check import nanochat_facts, nanochat_model, nanochat_optimizers, nvidia_driver
from nanochat.common import gpu_peak_flops
from nanochat.files import atomic_write_bytes
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train import attention, memory
from nanochat.train.compile import compile_regions
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import clipped_step, reduce_gradients, setup_optimizers

WARMUP, TIMED = 2, 10  # the first warm-up step compiles (warmup_s in the report)


@dataclasses.dataclass(frozen=True)
class Size:
    model: dict  # GPTConfig fields shared by every variant
    plain_batch: int
    trm_sequences: int  # the planner's inputs for the TRM's batch: sequences per process, at most ...
    trm_max_batch: int
    memory_bytes: int | None  # None: the device's own
    dtype: str = "bfloat16"


SIZES = {
    "full": Size(model=dict(n_layer=12, n_embd=768, n_head=6, n_kv_head=6, sequence_len=2048, vocab_size=65536),
                 plain_batch=32, trm_sequences=64, trm_max_batch=32, memory_bytes=None),
    "toy": Size(model=dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2, sequence_len=32, vocab_size=256),
                plain_batch=2, trm_sequences=4, trm_max_batch=2, memory_bytes=2 ** 30),
}


# issue 57's recipes, spelled out so that the variants stay these models whatever gpt.py's defaults become
HOLDING = dict(sample_n_sup="lognormal_poisson", backprop_steps=4, detach_between_steps=True)
DETACHED = dict(sample_n_sup=False, backprop_steps=1, detach_between_steps=True)


@dataclasses.dataclass
class Variant:
    name: str
    kind: str  # ours | head
    plain: bool = True
    scope: str = "layer"
    head_chunks: int | None = 16  # ours: the head's chunks (None: the plan's)
    diagnostics: bool = False
    state_dtype: str = "float32"
    autocast: bool = True
    recipe: dict = dataclasses.field(default_factory=dict)  # TRM config fields over the size's (issue 57's recipes)
    recompute: bool = False  # TRM: activation checkpointing at the largest batch that fits with it, not the plan's


VARIANTS = [
    Variant("plain_layer_16", "ours", diagnostics=True),
    Variant("head_native", "head", autocast=False),
    Variant("plain_model_1", "ours", scope="model", head_chunks=1),
    Variant("plain_model_2", "ours", scope="model", head_chunks=2),
    Variant("plain_layer_4", "ours", head_chunks=4),
    Variant("plain_layer_1", "ours", head_chunks=1),
    Variant("plain_layer_16_nodiag", "ours"),
    Variant("plain_model_1_bf16", "ours", scope="model", head_chunks=1, state_dtype="bfloat16"),
    Variant("head_autocast", "head"),
    Variant("trm_fp32", "ours", plain=False, head_chunks=None),
    Variant("trm_bf16", "ours", plain=False, head_chunks=None, state_dtype="bfloat16"),
    Variant("trm_holding", "ours", plain=False, head_chunks=None, recipe=HOLDING),
    Variant("trm_holding_recompute", "ours", plain=False, head_chunks=None, recipe=HOLDING, recompute=True),
    Variant("trm_detached", "ours", plain=False, head_chunks=None, recipe=DETACHED),
]
HOLDING_BAR = 0.45  # issue 57: the new default's MFU at the planner's batch


class Device:
    """The device's clock, syncs and memory: torch.cuda on CUDA, stand-ins on CPU (no sync, no memory figure). Syncs
    are counted, so the report shows ours and HEAD's step timed with the same ones."""

    def __init__(self, device):
        self.device, self.syncs = device, 0

    @property
    def cuda(self):
        return self.device.type == "cuda"

    def sync(self):
        self.syncs += 1
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def fresh(self):
        """As a new process: no graph compiled for an earlier variant, no earlier variant's memory in the peak."""
        torch._dynamo.reset()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self):
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def memory_bytes(self, size):
        if size.memory_bytes:
            return size.memory_bytes
        return torch.cuda.get_device_properties(self.device).total_memory

    def name(self):
        return torch.cuda.get_device_name(self.device) if self.cuda else "cpu"


def random_batch(device, vocab_size, batch, sequence_len):
    tokens = torch.randint(0, vocab_size, (batch, sequence_len + 1), device=device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def host_reads(fn):
    """(fn's result, how many times a tensor's value reached Python inside it: each a host sync on a GPU)."""
    counted, saved = [], {}
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        saved[name] = real = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, lambda self, *a, _real=real, **k: counted.append(1) or _real(self, *a, **k))
    try:
        return fn(), len(counted)
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


# ---------------------------------------------------------------------------------------------------- one variant
def timed_steps(dev, fwd_bwd, update, zero_grad):
    """WARMUP then TIMED steps, each: sync, forward+backward, sync, the optimizer, sync. Returns the timings and the
    syncs a timed step made."""
    start = time.perf_counter()
    for _ in range(WARMUP):
        dev.sync()
        fwd_bwd()
        update()
        zero_grad()
    dev.sync()
    warmup_s = time.perf_counter() - start
    if dev.cuda:
        torch.cuda.reset_peak_memory_stats(dev.device)
    fb, opt, reads = [], [], 0
    syncs = dev.syncs
    for _ in range(TIMED):
        dev.sync()
        t0 = time.perf_counter()
        fwd_bwd()
        dev.sync()
        t1 = time.perf_counter()
        _, n = host_reads(update)
        dev.sync()
        t2 = time.perf_counter()
        zero_grad()
        fb.append(t1 - t0)
        opt.append(t2 - t1)
        reads = max(reads, n)
    per_step = (dev.syncs - syncs) / TIMED
    return {"fwd_bwd_s": statistics.median(fb), "optimizer_s": statistics.median(opt),
            "step_s": statistics.median(a + b for a, b in zip(fb, opt)), "fwd_bwd_all_s": fb, "optimizer_all_s": opt,
            "syncs_per_step": per_step, "optimizer_host_reads": reads, "peak_memory_bytes": dev.peak(),
            "warmup_s": round(warmup_s, 2)}


SDPA_OPS = re.compile(r"scaled_dot_product|flash_attn|fmha|cudnn.*attention", re.I)


def profiled_step(dev, fwd_bwd, update, zero_grad, top=12):
    """One step under the profiler: the top kernels (CUDA: by device time; CPU: ops by self CPU time) and the names
    of the attention ops that ran (with the backend each stands for)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.cuda else [])
    with profile(activities=activities) as prof:
        fwd_bwd()
        update()
        dev.sync()
    zero_grad()
    averages = prof.key_averages()
    if dev.cuda:  # the kernels themselves (an op's own row counts the kernels it launched too)
        key = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
        rows = [e for e in averages if key(e) > 0 and getattr(e, "device_type", None) == DeviceType.CUDA]
        rows = rows or [e for e in averages if key(e) > 0]
    else:
        key = lambda e: e.self_cpu_time_total  # noqa: E731
        rows = list(averages)
    total = sum(key(e) for e in rows) or 1
    kernels = [{"name": e.key[:160], "calls": e.count, "ms": round(key(e) / 1e3, 3), "share": round(key(e) / total, 4)}
               for e in sorted(rows, key=key, reverse=True)[:top]]
    ops = sorted({e.key for e in averages if SDPA_OPS.search(e.key)})
    backends = sorted({attention.OPS[op] for op in ops if op in attention.OPS})
    return {"top_kernels": kernels, "sdpa_ops": ops, "sdpa": ", ".join(backends) or (ops[0] if ops else "none seen")}


def ours(dev, size, variant, backend):
    """Our model as base_train steps it, in the variant's compile scope, head chunks, diagnostics and state dtype."""
    config = GPTConfig(**size.model)
    config = (config.replace(n_loops=0, n_sup_train=1, n_sup_inference=1) if variant.plain else
              config.replace(**variant.recipe, activation_checkpointing=variant.recompute))
    config = config.replace(state_dtype=variant.state_dtype)
    planned = None
    if variant.plain:
        batch, checkpointing = size.plain_batch, False
    else:  # the launcher's choice (memory.choose_micro_batch); recompute: its checkpointed side
        choice = memory.choose_micro_batch(config, size.trm_sequences, size.trm_max_batch, dev.memory_bytes(size),
                                           size.dtype)
        if choice is None:
            raise RuntimeError("the planner fits not even one sequence")
        batch, checkpointing = choice.chosen.batch, choice.chosen.checkpointing
        planned = {"planned_time": choice.chosen.time,
                   "planned_other": choice.other._asdict() if choice.other else None}
    config = config.replace(activation_checkpointing=checkpointing)
    chunks = variant.head_chunks if variant.head_chunks is not None else memory.head_chunks_that_fit(
        config, batch, dev.memory_bytes(size), size.dtype, compiled=True)
    torch.manual_seed(0)
    model = GPT(config).to(dev.device)
    model.init_weights()
    model.head_chunks = chunks
    optimizers = setup_optimizers(model)
    compile_regions(model, variant.scope, backend=backend)
    x, y = random_batch(dev.device, config.vocab_size, batch, config.sequence_len)
    autocast = torch.autocast(dev.device.type, dtype=torch.bfloat16) if size.dtype == "bfloat16" else \
        contextlib.nullcontext()

    def fwd_bwd():  # n_sup_train steps: a drawn count's mean, and with backprop_steps=4 all of them alive at once
        with autocast:
            model.forward_backward(x, y, n_sup=config.n_sup_train, diagnostics=variant.diagnostics)

    def update():  # base_train's: the squared norm reduced, read once on the host, the clipped step
        clipped_step(optimizers, reduce_gradients(optimizers).sqrt().item(), 1.0)

    facts = {"batch": batch, "activation_checkpointing": checkpointing, "head_chunks": chunks,
             "compile_scope": variant.scope, "diagnostics": variant.diagnostics, "state_dtype": variant.state_dtype,
             "flops_per_token": estimate_flops(model, n_sup=config.n_sup_train), "tokens": batch * config.sequence_len,
             **({"recipe": variant.recipe, **planned} if planned else {}),
             "estimated_memory_bytes": memory.estimate_memory(config, batch, size.dtype, head_chunks=chunks,
                                                              compiled=True)["total"]}
    return facts, fwd_bwd, update, lambda: model.zero_grad(set_to_none=True)


def head(dev, size, variant, backend, load):
    """nanochat HEAD's GPT and optimizer as its base_train steps them (compiled whole), with or without autocast."""
    config = GPTConfig(**size.model).replace(n_loops=0, n_sup_train=1, n_sup_inference=1)
    model = nanochat_model(load("nanochat.gpt"), types.SimpleNamespace(device=dev.device), config)
    optimizers = nanochat_optimizers(model)
    compiled = torch.compile(model, dynamic=False, backend=backend)
    x, y = random_batch(dev.device, config.vocab_size, size.plain_batch, config.sequence_len)
    autocast = torch.autocast(dev.device.type, dtype=torch.bfloat16) if variant.autocast else \
        contextlib.nullcontext()

    def fwd_bwd():
        with autocast:
            loss = compiled(x, y)
        loss.backward()

    def update():
        for optimizer in optimizers:
            optimizer.step()

    flops = model.estimate_flops() if hasattr(model, "estimate_flops") else None
    facts = {"batch": size.plain_batch, "autocast": variant.autocast, "tokens": size.plain_batch * config.sequence_len,
             "flops_per_token": flops, **nanochat_facts(load)}
    return facts, fwd_bwd, update, lambda: model.zero_grad(set_to_none=True)


def run_variant(dev, size, variant, backend, nanochat):
    """The variant's measurements; an error (out of memory too) is recorded as the variant's result."""
    dev.fresh()
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if variant.kind == "head":
            if not nanochat:
                return {"error": "not run: no --nanochat DIR (bash dev/gpu_carry.sh --model-only NANOCHAT)"}
            load = stack.enter_context(other_nanochat(nanochat))  # HEAD's code imports its modules while it runs
            facts, fwd_bwd, update, zero_grad = head(dev, size, variant, backend, load)
        else:
            facts, fwd_bwd, update, zero_grad = ours(dev, size, variant, backend)
        try:
            timings = timed_steps(dev, fwd_bwd, update, zero_grad)
            profiled = profiled_step(dev, fwd_bwd, update, zero_grad)
        except torch.OutOfMemoryError as e:
            return {**facts, "error": f"out of memory: {str(e).splitlines()[0][:200]}", "peak_memory_bytes": dev.peak()}
    result = {**facts, **timings, **profiled, "wall_s": round(time.perf_counter() - t0, 2)}
    result["tok_per_s"] = facts["tokens"] / timings["step_s"]
    peak = gpu_peak_flops(dev.name()) if dev.cuda else None
    result["mfu"] = facts["flops_per_token"] * result["tok_per_s"] / peak if peak and facts["flops_per_token"] else None
    return result


# ---------------------------------------------------------------------------------------------------- the report
def cell(text):
    return str(text).replace("|", "/").replace("\n", " ")


def markdown(report):
    variants = report["variants"]
    native = variants.get("head_native", {})
    lines = [f"# The step gap to nanochat HEAD: {report['environment']['device']}, {report['created']}", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in report["environment"].items()),
             f"HEAD: {report.get('head', {})}", "",
             f"Median of {TIMED} steps after {WARMUP} warm-up steps; syncs before, between and after the parts. "
             "Ratios are over head_native's (HEAD as it trains itself).", "",
             "| variant | fwd+bwd s | optimizer s | step s | fwd+bwd / HEAD | step / HEAD | MFU | peak GB | est. GB | "
             "SDPA | top kernel |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in variants.items():
        if "error" in v:
            lines.append(f"| {name} | {cell(v['error'])} | | | | | | | | | |")
            continue
        ratio = lambda key: f"{v[key] / native[key]:.3f}" if native.get(key) else "n/a"  # noqa: E731
        gb = lambda b: f"{b / 1e9:.1f}" if b else "n/a"  # noqa: E731
        mfu = "n/a" if v["mfu"] is None else f"{100 * v['mfu']:.1f}%"
        top = cell(v["top_kernels"][0]["name"][:60]) if v["top_kernels"] else ""
        lines.append(f"| {name} | {v['fwd_bwd_s']:.4f} | {v['optimizer_s']:.4f} | {v['step_s']:.4f} | "
                     f"{ratio('fwd_bwd_s')} | {ratio('step_s')} | {mfu} | {gb(v['peak_memory_bytes'])} | "
                     f"{gb(v.get('estimated_memory_bytes'))} | {cell(v['sdpa'])} | {top} |")
    for name, why in report["skipped"].items():
        lines.append(f"| {name} | skipped: {cell(why)} | | | | | | | | | |")
    holding = variants.get("trm_holding", {})
    if holding.get("mfu") is not None:
        lines += ["", f"Issue 57's bar: trm_holding at {100 * holding['mfu']:.1f}% MFU at the planner's batch "
                      f"{holding['batch']}{' (recomputing)' if holding['activation_checkpointing'] else ''}: "
                      f"{'met' if holding['mfu'] >= HOLDING_BAR else 'NOT met'} (>= {HOLDING_BAR:.0%})."]
    sides = [variants.get(name, {}) for name in ("trm_holding", "trm_holding_recompute")]
    if all("step_s" in v and v.get("planned_time") for v in sides):
        measured = sides[1]["step_s"] / sides[1]["tokens"] / (sides[0]["step_s"] / sides[0]["tokens"])
        lines.append(f"Recompute or accumulate: the recomputing batch {sides[1]['batch']} took {measured:.2f}x the "
                     f"time per token of batch {sides[0]['batch']}; the plan expected "
                     f"{sides[1]['planned_time'] / sides[0]['planned_time']:.2f}x (memory.choose_micro_batch).")
    return "\n".join(lines) + "\n"


def write(out, report):
    atomic_write_bytes(os.path.join(out, "gap.json"), json.dumps(report, indent=2, default=str).encode())
    atomic_write_bytes(os.path.join(out, "gap.md"), markdown(report).encode())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dev.gpu_gap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=list(SIZES), default=None, help="full (default on cuda) or toy (cpu)")
    parser.add_argument("--nanochat", default=None, metavar="DIR", help="nanochat HEAD: a checkout, or the copy "
                        "dev/gpu_carry.sh --model-only makes (.gpu_carry/nanochat)")
    parser.add_argument("--out", required=True, help="directory for gap.json and gap.md")
    parser.add_argument("--variants", default="", help="comma-separated names (default: all, in the listed order)")
    parser.add_argument("--budget_s", type=float, default=300.0, help="start no variant after this many seconds "
                        "(the slowest, a TRM, takes ~1 min on an H100: under `timeout 360` nothing is cut)")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: the CPU test's)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; run on the GPU machine, or pass --device cpu")
    if args.nanochat and not os.path.isfile(os.path.join(args.nanochat, "nanochat", "gpt.py")):
        parser.error(f"--nanochat {args.nanochat}: no nanochat/gpt.py there; bash dev/gpu_carry.sh --model-only "
                     f"NANOCHAT_CHECKOUT makes .gpu_carry/nanochat")
    known = {v.name for v in VARIANTS}
    unknown = [n for n in filter(None, args.variants.split(",")) if n not in known]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; give a directory (created if missing)")
    args.size = args.size or ("full" if args.device == "cuda" else "toy")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    dev, size = Device(device), SIZES[args.size]
    if dev.cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # as base_train
    os.makedirs(args.out, exist_ok=True)
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants.split(",")]
    commit = os.path.join(args.nanochat, "COMMIT") if args.nanochat else None
    report = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": {"torch": torch.__version__, "cuda": torch.version.cuda, "device": dev.name(),
                              "driver": nvidia_driver() if dev.cuda else None},
              "size": dataclasses.asdict(size), "backend": args.backend, "warmup": WARMUP, "timed": TIMED,
              "head": {"dir": args.nanochat, "commit": open(commit).read().strip()
                       if commit and os.path.exists(commit) else None},
              "variants": {}, "skipped": {}}
    t0 = time.perf_counter()
    for variant in chosen:
        if time.perf_counter() - t0 > args.budget_s:
            report["skipped"][variant.name] = f"past --budget_s={args.budget_s:g}"
            continue
        try:
            result = run_variant(dev, size, variant, args.backend, args.nanochat)
        except Exception as e:  # noqa: BLE001 - one variant's failure must not cost the others
            result = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"}
        report["variants"][variant.name] = result
        if variant.kind == "head" and "has_fa3" in result:
            report["head"].update({k: result[k] for k in ("has_fa3", "use_fa3", "compute_dtype")})
        report["wall_s"] = round(time.perf_counter() - t0, 1)
        write(args.out, report)
        shown = result.get("error") or (f"fwd+bwd {result['fwd_bwd_s']:.4f} s, optimizer {result['optimizer_s']:.4f}"
                                        f" s, step {result['step_s']:.4f} s, sdpa {result['sdpa']}")
        print(f"[{time.perf_counter() - t0:6.1f} s] {variant.name}: {shown}", flush=True)
    write(args.out, report)
    print("\n" + markdown(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
