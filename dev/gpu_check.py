"""
The GPU check kit: before paying for a long run, check in minutes that this machine trains, resumes, samples and
exports the model as the plan expects, and measure what a step costs here.

    python -m dev.gpu_check --quick --nanochat DIR           # the 5-minute kit: facts and the three steps, no rustbpe
    python -m dev.gpu_check                                  # every check at the real sizes (needs rustbpe)
    python -m dev.gpu_check --nanochat ~/src/nanochat        # also time karpathy/nanochat's GPT (a checkout of it)
    python -m dev.gpu_check --device cpu                     # every check at a tiny size (CI; under 3 minutes)

The checks, in order (--quick runs the ones marked *: no tokenizer training, so no rustbpe):
  * environment, peak_flops    torch, CUDA and driver versions, the device, its peak bf16 FLOP/s from the table
  * torch_lock                 the torch running here against requirements.lock's (older works, see pyproject)
  * allocator                  whether expandable segments took effect (nanochat/cuda_allocator.py)
  * attention                  which SDPA backend runs at the model's shape, and each backend's fwd+bwd time
  * kv_cache_dtype             the dtype the KV cache stores under autocast
    tiny_compile               torch.compile builds and gives the eager result
  * plain_*, trm_*             a compiled depth-12 training micro-step of a plain GPT (n_loops=0, n_sup_train=1) and of
                               gpt.py's TRM defaults, at the planner's micro-batch (nanochat/train/memory.py), as
                               base_train runs it (regional compile, forward_backward, bf16 autocast on CUDA): step
                               time, tokens/s, MFU (of the whole step, optimizer included), peak memory against the
                               planner's estimate, recompiles and graph breaks
  * trm_bf16_state             the same TRM step with the recursion state in bf16 (bf16 autocast only), and its
                               tokens/s and peak memory over the float32 state's
  * nanochat_compare           the same plain step of nanochat's own GPT and optimizer (--nanochat DIR: a checkout, or
                               a copy of its nanochat/ package), and our time over theirs
    train_run, train_resume    torchrun base_train for 30 steps with evaluation, samples and checkpoints, then a
                               second run resumed from step 20 must retrain steps 21-30 with the first run's losses
                               (on CPU: 6 steps, resumed from step 4)
    kv_cache_logits, decode    cached against uncached generation logits (bf16 on CUDA), and decode tokens/s
    export_hf                  scripts/export_hf.py's export, loaded by transformers, computes our logits

report.json and report.md go to --out (default dev/results/gpu/<date>-<device>/ on CUDA, a temporary directory on
CPU); the table is printed, and the exit code is 1 when any check failed. Every check runs whatever the others did:
an exception fails its own check with the error. The training run's data, tokenizer and checkpoints, the export
and transformers' copy of its code live in --out/work (removed when every check passed; the subprocesses' logs stay
in --out/logs): nothing of yours is read or changed.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from dev.bench_model import optimizer_step
from nanochat.cli import ExitCode
from nanochat.common import gpu_peak_flops
from nanochat.files import atomic_write_bytes
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train import attention, memory
from nanochat.train.compile import compile_regions, compile_scope_for
from nanochat.train.flops import estimate_flops
from nanochat.train.optim import setup_optimizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_TAG = "gpucheck"


@dataclass(frozen=True)
class Sizes:
    """How big each check runs on a device type."""
    model: dict  # GPTConfig fields of the micro-step models; the recursion comes from gpt.py (TRM) or is off (plain)
    sequences_per_rank: int  # the planner's inputs: sequences each process trains per optimizer step ...
    max_batch: int  # ... and the device batch it starts from (scripts/launch.py's 8xH100 fast row: 32 x 2)
    memory_bytes: int | None  # the memory the planner fits into; None: the device's own
    timed_steps: int
    train_flags: list  # base_train's model, batch and evaluation flags for the 30-step run
    tokenizer: list  # scripts.tok_train's flags
    prompt_tokens: int
    decode_tokens: int
    process_timeout_s: int  # each subprocess of the training check
    attention_batch: int  # the attention check's batch (at the model's heads and sequence_len)
    # the training run: its steps, and the step the second run resumes from (checkpoints and evaluations every
    # train_steps - resume_from steps)
    train_steps: int = 30
    resume_from: int = 20
    dtype: str = "bfloat16"
    compile_train: bool = True
    # the micro-steps' torch.compile backend: CPU's checks the capture (graphs, recompiles, breaks) with aot_eager,
    # as the model's fast tests do; inductor's C++ build of the steps' graphs took a minute more (tiny_compile and the
    # slow tests check inductor on CPU)
    compile_backend: str = "inductor"


SIZES = {
    "cuda": Sizes(model=dict(n_layer=12), sequences_per_rank=64, max_batch=32, memory_bytes=None, timed_steps=3,
                  train_flags=["--depth=4", "--max_seq_len=512", "--device_batch_size=8", "--n_loops=1",
                               "--n_sup_train=2", "--eval_tokens=16384", "--sample_tokens=16"],
                  tokenizer=["--vocab_size=4096", "--max_chars=5000000"], prompt_tokens=128, decode_tokens=32,
                  process_timeout_s=240, attention_batch=16),
    # CPU: the plumbing of every check at the least that runs each stage (2 layers: the capture of a layer visit and of
    # a whole model alike; 6 steps: 3 checkpoints and evaluations, 2 steps retrained after the resume)
    "cpu": Sizes(model=dict(n_layer=2, n_embd=32, n_head=2, n_kv_head=2, sequence_len=32, vocab_size=512),
                 sequences_per_rank=4, max_batch=4, memory_bytes=2**30, timed_steps=2,
                 train_flags=["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2",
                              "--n_loops=1", "--n_sup_train=2", "--eval_tokens=256", "--sample_tokens=4"],
                 tokenizer=["--vocab_size=300", "--max_chars=200000"], prompt_tokens=16, decode_tokens=8,
                 process_timeout_s=120, attention_batch=2, dtype="float32", compile_train=False,
                 compile_backend="aot_eager", train_steps=6, resume_from=4),
}


@dataclass
class Context:
    """What the checks share: the device, the sizes, where to write, and the results later checks build on."""
    device: torch.device
    sizes: Sizes
    out: str
    nanochat: str | None
    results: dict = field(default_factory=dict)  # check name -> measurements (also written to report.json)

    @property
    def work(self):
        """The training run's data, tokenizer and checkpoints, and the export: removed when every check passed."""
        return os.path.join(self.out, "work")

    @property
    def base_dir(self):
        return os.path.join(self.work, "nanochat_base")

    def autocast(self):
        if self.sizes.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def row(name, ok, value, expected):
    return {"name": name, "ok": bool(ok), "value": value, "expected": expected}


# ---------------------------------------------------------------------------------------------------- environment
def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")


def nvidia_driver():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30, check=True).stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def environment(device):
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device_name(device), "cpu_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(driver=nvidia_driver(), memory_gb=round(props.total_memory / 1e9, 1),
                   capability=f"{props.major}.{props.minor}", peak_bf16_flops=gpu_peak_flops(env["device"]))
    return env


def check_environment(ctx):
    env = ctx.results["environment"] = environment(ctx.device)
    value = f"torch {env['torch']}, CUDA {env['cuda']}, driver {env.get('driver')}, {env['device']}"
    works = torch.ones(2, device=ctx.device).sum().item() == 2
    return row("environment", works, value, "the device computes")


def check_peak_flops(ctx):
    if ctx.device.type != "cuda":
        return row("peak_flops", True, "not applicable on cpu (no MFU)", "a cuda device in the table")
    name = device_name(ctx.device)
    peak = gpu_peak_flops(name)
    value = f"{peak / 1e12:,.0f} TFLOP/s for {name!r}" if peak else f"{name!r} is not in the table: MFU not shown"
    return row("peak_flops", peak is not None, value, "in nanochat/common.py GPU_PEAK_BF16_FLOPS")


def check_tiny_compile(ctx):
    def f(x, w):
        return torch.nn.functional.gelu(x @ w).sum(-1) + x.sin().mean()

    torch._dynamo.reset()
    x, w = torch.randn(16, 32, device=ctx.device), torch.randn(32, 32, device=ctx.device)
    eager, compiled = f(x, w), torch.compile(f)(x, w)
    diff = (eager - compiled).abs().max().item()
    return row("tiny_compile", diff <= 1e-3, f"max |compiled - eager| = {diff:.1e}", "<= 1e-3")


# ---------------------------------------------------------------------------------------------------- facts
MIN_TORCH = "2.11"  # the oldest torch the code runs on (pyproject.toml's range): the GPU machine's and cloud images'


def locked_version(package, lock=os.path.join(ROOT, "requirements.lock")):
    """The version requirements.lock pins, or None."""
    with open(lock) as f:
        for line in f:
            found = re.match(rf"{re.escape(package)}==([^\s;]+)", line.strip())
            if found:
                return found.group(1)
    return None


def version_tuple(version):
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def check_torch_lock(ctx):
    running, locked = torch.__version__, locked_version("torch")
    ok = version_tuple(running) >= version_tuple(MIN_TORCH)
    same = "the lock's" if locked and version_tuple(running) == version_tuple(locked) else f"lock has {locked}"
    return row("torch_lock", ok, f"torch {running} ({same})", f">= {MIN_TORCH} (pyproject.toml); the suite passed "
               f"on the lock's")


def expandable_segments(snapshot):
    """Whether the caching allocator's segments are expandable (a torch.cuda.memory_snapshot()); None: no segment."""
    flags = [segment["is_expandable"] for segment in snapshot if "is_expandable" in segment]
    return all(flags) if flags else None


def check_allocator(ctx):
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    wanted = "expandable_segments:true" in conf.replace(" ", "").lower()
    if ctx.device.type != "cuda":
        return row("allocator", True, f"not applicable on cpu (setting: {conf!r})", "expandable segments on cuda")
    keep = torch.empty(2**20, device=ctx.device)  # at least one segment to look at
    found = expandable_segments(torch.cuda.memory_snapshot())
    del keep
    ctx.results["allocator"] = {"setting": conf, "expandable_segments": found}
    return row("allocator", found == wanted, f"expandable segments {found} (setting {conf!r})",
               f"{wanted}, as the setting asks")


def check_attention(ctx):
    config = micro_step_config(ctx, plain=True)
    dtype = torch.float32 if ctx.sizes.dtype == "float32" else torch.bfloat16
    q, k, v = attention.attention_inputs(ctx.sizes.attention_batch, config.n_head, config.n_kv_head,
                                         config.sequence_len, config.n_embd // config.n_head, ctx.device, dtype)
    runs = attention.backend_that_runs(q, k, v)
    timings = attention.time_backends(q, k, v, repeats=ctx.sizes.timed_steps * 2)
    ctx.results["attention"] = {"default": runs, "fwd_bwd_s": timings, "shape": list(q.shape),
                                "fastest": attention.fastest(timings)}
    shown = ", ".join(f"{name} {s * 1e3:.2f} ms" if isinstance(s, float) else f"{name} n/a"
                      for name, s in timings.items())
    return row("attention", runs in attention.BACKENDS, f"SDPA runs {runs} by default at {tuple(q.shape)} "
               f"{ctx.sizes.dtype}; fwd+bwd: {shown}; fastest {ctx.results['attention']['fastest']}",
               "one backend runs; each timed")


def check_kv_cache_dtype(ctx):
    from dev.bench_engine import random_model
    from nanochat.model.engine import Engine
    model = random_model(micro_step_config(ctx, plain=False).replace(n_layer=1), ctx.device)
    prompt = torch.randint(0, model.config.vocab_size, (1, ctx.sizes.prompt_tokens), device=ctx.device)
    cache = Engine(model).new_cache(1, prompt.size(1), model.config.n_sup_inference)
    with torch.inference_mode(), ctx.autocast():
        model(prompt, kv_cache=cache)
    stored, wanted = cache.k[0].dtype, torch.float32 if ctx.sizes.dtype == "float32" else torch.bfloat16
    ctx.results["kv_cache_dtype"] = str(stored)
    return row("kv_cache_dtype", stored == wanted, f"{stored} under {ctx.sizes.dtype} autocast", str(wanted))


# ---------------------------------------------------------------------------------------------------- micro-steps
def micro_step_config(ctx, plain):
    config = GPTConfig(**ctx.sizes.model)
    return config.replace(n_loops=0, n_sup_train=1, n_sup_inference=1) if plain else config


def device_memory(ctx):
    if ctx.sizes.memory_bytes:
        return ctx.sizes.memory_bytes
    return torch.cuda.get_device_properties(ctx.device).total_memory


def planned_batch(ctx, config):
    """(device batch, activation checkpointing) as scripts/launch.py plans them for this device's memory."""
    s = ctx.sizes
    fit = memory.fit_micro_batch(config, s.sequences_per_rank, s.max_batch, device_memory(ctx), s.dtype)
    if fit is None:
        raise RuntimeError(f"the planner fits not even one sequence in {device_memory(ctx) / 1e9:.0f} GB")
    return fit


def graph_counts():
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def random_batch(ctx, config, batch):
    """Inputs and targets, contiguous as the data loader makes them."""
    tokens = torch.randint(0, config.vocab_size, (batch, config.sequence_len + 1), device=ctx.device)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def fresh_process(ctx):
    """As a new process: no graphs compiled for an earlier model, and no earlier model's memory in the peak."""
    torch._dynamo.reset()
    gc.collect()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


def run_micro_steps(ctx, config):
    """Build, compile (regionally) and train 1 + timed_steps steps as base_train does; returns the measurements."""
    batch, checkpointing = planned_batch(ctx, config)
    config = config.replace(activation_checkpointing=checkpointing)
    head_chunks = memory.head_chunks_that_fit(config, batch, device_memory(ctx), ctx.sizes.dtype, compiled=True)
    scope = compile_scope_for(config)[0]  # base_train's defaults: --compile_scope=auto and the plan's head
    fresh_process(ctx)
    torch.manual_seed(0)
    model = GPT(config).to(ctx.device)
    model.init_weights()
    model.head_chunks = head_chunks
    optimizers = setup_optimizers(model)
    graphs0, breaks0 = graph_counts()
    compile_regions(model, scope, backend=ctx.sizes.compile_backend)
    x, y = random_batch(ctx, config, batch)

    def step():
        ctx.sync()
        t0 = time.perf_counter()
        with ctx.autocast():
            loss, _ = model.forward_backward(x, y)
        ctx.sync()
        t1 = time.perf_counter()
        optimizer_step(optimizers)  # base_train's update at --grad_clip=1.0
        model.zero_grad(set_to_none=True)
        ctx.sync()
        return t1 - t0, time.perf_counter() - t0, loss.item()

    _, first_s, first_loss = step()  # compiles; the optimizer state exists from here on, as in the estimate
    graphs1, _ = graph_counts()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    timed = [step() for _ in range(ctx.sizes.timed_steps)]
    graphs2, breaks2 = graph_counts()
    seconds = statistics.median(t for _, t, _ in timed)  # the whole step: MFU counts the optimizer's time too
    tok_per_s = batch * config.sequence_len / seconds
    peak = gpu_peak_flops(device_name(ctx.device)) if ctx.device.type == "cuda" else None
    return {"batch": batch, "activation_checkpointing": checkpointing, "sequence_len": config.sequence_len,
            "compile_scope": scope, "head_chunks": head_chunks,
            "first_step_s": first_s, "step_s": seconds, "fwd_bwd_s": statistics.median(t for t, _, _ in timed),
            "tok_per_s": tok_per_s, "mfu": estimate_flops(model) * tok_per_s / peak if peak else None,
            "losses": [first_loss] + [loss for _, _, loss in timed],
            "peak_memory_bytes": torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else None,
            "estimated_memory_bytes": memory.estimate_memory(config, batch, ctx.sizes.dtype, head_chunks=head_chunks,
                                                             compiled=True)["total"],
            "graphs_compiled": graphs1 - graphs0, "recompiles": graphs2 - graphs1, "graph_breaks": breaks2 - breaks0}


def micro_step_rows(name, m):
    mfu = f", MFU {100 * m['mfu']:.1f}%" if m["mfu"] is not None else ", MFU n/a"
    ckpt = " + activation checkpointing" if m["activation_checkpointing"] else ""
    head = f", head in {m['head_chunks'] or 'default'} chunk(s), compile scope {m['compile_scope']}"
    rows = [row(f"{name}_step", all(map(math.isfinite, m["losses"])),
                f"batch {m['batch']}x{m['sequence_len']}{ckpt}{head}: {m['step_s']:.3f} s a step "
                f"({m['fwd_bwd_s']:.3f} s fwd+bwd), {m['tok_per_s']:,.0f} tok/s{mfu} "
                f"(first step {m['first_step_s']:.1f} s)",
                "finite losses")]
    est = m["estimated_memory_bytes"]
    if m["peak_memory_bytes"] is None:
        rows.append(row(f"{name}_memory", True, "not measured on cpu", f"<= {est / 1e9:.3f} GB (planner)"))
    else:
        peak = m["peak_memory_bytes"]
        rows.append(row(f"{name}_memory", peak <= est, f"{peak / 1e9:.2f} GB peak ({peak / est:.0%} of estimate)",
                        f"<= {est / 1e9:.2f} GB (planner)"))
    rows.append(row(f"{name}_recompiles", m["recompiles"] == 0,
                    f"{m['recompiles']} after the first step ({m['graphs_compiled']} graphs in it)", "0"))
    rows.append(row(f"{name}_graph_breaks", m["graph_breaks"] == 0, str(m["graph_breaks"]), "0"))
    return rows


def check_plain(ctx):
    ctx.results["plain"] = run_micro_steps(ctx, micro_step_config(ctx, plain=True))
    return micro_step_rows("plain", ctx.results["plain"])


def check_trm(ctx):
    ctx.results["trm"] = run_micro_steps(ctx, micro_step_config(ctx, plain=False))
    return micro_step_rows("trm", ctx.results["trm"])


def check_trm_bf16_state(ctx):
    """The TRM step with the recursion state in bf16 (--state_dtype=bfloat16), against the float32 state's: the
    speed and memory that decide gpt.py's default (measured on CPU only so far: dev/LOG.md, "A bf16 recursion
    state")."""
    if ctx.sizes.dtype == "float32":
        return [row("trm_bf16_state", True, "not run: a bf16 state needs bf16 autocast, and this run is float32",
                    "bf16 autocast")]
    fp32 = ctx.results.get("trm") or run_micro_steps(ctx, micro_step_config(ctx, plain=False))
    bf16 = run_micro_steps(ctx, micro_step_config(ctx, plain=False).replace(state_dtype="bfloat16"))
    ctx.results["trm_bf16_state"] = bf16
    return micro_step_rows("trm_bf16_state", bf16) + [bf16_state_against_fp32(bf16, fp32)]


def bf16_state_against_fp32(bf16, fp32):
    """One row: tokens/s and peak memory of the bf16 state over the float32 state's (each at its planned batch)."""
    memory_ratio = ("peak memory not measured" if bf16["peak_memory_bytes"] is None else
                    f"peak memory {bf16['peak_memory_bytes'] / fp32['peak_memory_bytes']:.2f}x")
    return row("trm_bf16_state_vs_fp32", True,
               f"tokens/s {bf16['tok_per_s'] / fp32['tok_per_s']:.2f}x, {memory_ratio}, batch {bf16['batch']} vs "
               f"{fp32['batch']}, first loss {bf16['losses'][0]:.4f} vs {fp32['losses'][0]:.4f}",
               "the float32 state's (1.00x)")


# ---------------------------------------------------------------------------------------------------- nanochat
def nanochat_model(gpt, ctx, config):
    """karpathy/nanochat's GPT (gpt: its nanochat.gpt module), the size of our plain model, on this device."""
    from dataclasses import fields
    known = {f.name for f in fields(gpt.GPTConfig)}
    wanted = {k: getattr(config, k) for k in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")}
    if "window_pattern" in known:  # later versions slide a window over the context in some layers
        wanted["window_pattern"] = "L"  # every layer full context, as ours: the same attention FLOPs
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = gpt.GPT(gpt.GPTConfig(**{k: v for k, v in wanted.items() if k in known}))
    model.init_weights()
    return model


def nanochat_optimizers(model):
    """nanochat's own optimizers for its model: HEAD has one MuonAdamW (setup_optimizer), 2025 versions a list."""
    if hasattr(model, "setup_optimizer"):
        return [model.setup_optimizer()]
    return list(model.setup_optimizers())


def nanochat_facts(load):
    """What nanochat's modules decided at import (load: other_nanochat's import function): FlashAttention 3 or
    SDPA, and its compute dtype (HEAD's; a 2025 version, which trained under autocast, has none)."""
    facts = {}
    with contextlib.suppress(ImportError):
        fa = load("nanochat.flash_attention")
        facts.update(has_fa3=bool(getattr(fa, "HAS_FA3", False)), use_fa3=bool(getattr(fa, "USE_FA3", False)))
    dtype = None
    with contextlib.suppress(ImportError):
        dtype = getattr(load("nanochat.common"), "COMPUTE_DTYPE", None)
    return {**facts, "compute_dtype": None if dtype is None else str(dtype)}


def time_nanochat_step(ctx, config, batch):
    """(median seconds, nanochat_facts) of a compiled training step (forward, backward, its optimizers' step) of
    nanochat's GPT as its base_train runs it: HEAD without autocast (its compute dtype is its activations': a bf16
    residual), a 2025 version under autocast. Inside other_nanochat, since its code imports its own modules while
    torch.compile traces it."""
    from dev.bench_train_step import other_nanochat
    with other_nanochat(ctx.nanochat) as load:
        model = nanochat_model(load("nanochat.gpt"), ctx, config)
        optimizers = nanochat_optimizers(model)
        compiled = torch.compile(model, dynamic=False, backend=ctx.sizes.compile_backend)  # as ours: aot_eager on CPU
        x, y = random_batch(ctx, config, batch)
        facts = nanochat_facts(load)
        autocast = ctx.autocast if facts["compute_dtype"] is None else contextlib.nullcontext

        def step():
            ctx.sync()
            t0 = time.perf_counter()
            with autocast():
                loss = compiled(x, y)
            loss.backward()
            for optimizer in optimizers:
                optimizer.step()
            model.zero_grad(set_to_none=True)
            ctx.sync()
            return time.perf_counter() - t0

        step()  # compiles (the model, and HEAD's compiled optimizer updates)
        return statistics.median(step() for _ in range(ctx.sizes.timed_steps)), facts


def check_nanochat(ctx):
    if not ctx.nanochat:
        return row("nanochat_compare", True, "not given (--nanochat DIR to compare)", "skipped")
    ours = ctx.results.get("plain")
    if ours is None:
        raise RuntimeError("our plain step did not run (see plain_step): nothing to compare with")
    fresh_process(ctx)
    theirs, facts = time_nanochat_step(ctx, micro_step_config(ctx, plain=True), ours["batch"])
    ratio = ours["step_s"] / theirs
    ctx.results["nanochat"] = {"step_s": theirs, "ours_over_theirs": ratio, **facts}
    how = (f"its own {facts['compute_dtype']} without autocast" if facts["compute_dtype"] else "under autocast") + (
        f", FA3 {'used' if facts.get('use_fa3') else 'not used'}" if "use_fa3" in facts else "")
    return row("nanochat_compare", ratio <= 1.00, f"step with optimizer: ours {ours['step_s']:.3f} s / nanochat "
               f"{theirs:.3f} s = {ratio:.2f} (nanochat {how})", "<= 1.00 (issue 52; about the same FLOPs)")


# ---------------------------------------------------------------------------------------------------- training run
def run_process(ctx, args, what):
    """A python -m subprocess in the private base dir; its output is kept in --out/logs/<what>.log."""
    # the repository first, then whatever was there (wheels installed to a --target directory must reach the children)
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "NANOCHAT_BASE_DIR": ctx.base_dir, "PYTHONPATH": pythonpath, "WANDB_MODE": "disabled"}
    os.makedirs(os.path.join(ctx.out, "logs"), exist_ok=True)
    log = os.path.join(ctx.out, "logs", f"{what}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=ctx.sizes.process_timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RuntimeError(f"{what} still running after {ctx.sizes.process_timeout_s} s (log: {log})")
    if code != 0:
        with open(log) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["no output"]
        raise RuntimeError(f"{what} exited with {code}: {last[0][:200]} (log: {log})")


def base_train_args(ctx, *extra):
    s = ctx.sizes
    every = s.train_steps - s.resume_from
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m", "scripts.base_train", "--",
            *s.train_flags, f"--device_type={ctx.device.type}", f"--compile={str(s.compile_train).lower()}",
            f"--num_iterations={s.train_steps}", f"--save_every={every}", f"--eval_every={every}",
            "--sample_every=0", "--gradient_accumulation_steps=1", "--warmup_steps=2", "--save_every_minutes=0",
            "--keep_last=0", "--run=dummy", f"--model_tag={MODEL_TAG}", *extra]


def metrics(ctx):
    with open(os.path.join(ctx.base_dir, "base_checkpoints", MODEL_TAG, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_losses(records):
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def check_train_run(ctx):
    shutil.rmtree(ctx.base_dir, ignore_errors=True)  # the kit's own directory: a rerun starts from nothing
    run_process(ctx, ["-m", "nanochat.data.dataset", "--builtin"], "dataset")
    run_process(ctx, ["-m", "scripts.tok_train", *ctx.sizes.tokenizer], "tok_train")
    run_process(ctx, base_train_args(ctx), "base_train")
    records = metrics(ctx)
    losses = train_losses(records)
    evals = [r["step"] for r in records if r["kind"] == "eval"]
    samples = [r for r in records if r["kind"] == "sample"]
    saved = sorted(int(d[5:]) for d in os.listdir(os.path.join(ctx.base_dir, "base_checkpoints", MODEL_TAG))
                   if re.fullmatch(r"step_\d+", d))
    ctx.results["train"] = {"losses": losses, "eval_steps": evals, "checkpoints": saved}
    last = ctx.sizes.train_steps
    ok = (sorted(losses) == list(range(1, last + 1)) and evals[-1:] == [last] and samples and saved[-1:] == [last]
          and losses[last] < losses[1])
    return row("train_run", ok, f"{len(losses)} steps, loss {losses.get(1, math.nan):.3f} -> "
               f"{losses.get(last, math.nan):.3f}, evals at {evals}, {len(samples)} sample set(s), "
               f"checkpoints {saved}", f"{last} steps, loss falls, eval + samples + checkpoint at the end")


def check_train_resume(ctx):
    first = ctx.results.get("train")
    if first is None:
        raise RuntimeError("needs train_run's checkpoints, and train_run failed")
    last, resume_from = ctx.sizes.train_steps, ctx.sizes.resume_from
    run_process(ctx, base_train_args(ctx, f"--resume_from_step={resume_from}"), "base_train_resume")
    resumed = train_losses(metrics(ctx))
    steps = range(resume_from + 1, last + 1)
    # bit-identical in float32 on a CPU; compiled bf16 kernels (atomics in backward) may differ in the last bits
    tolerance = 1e-5 if ctx.sizes.dtype == "float32" else 2e-2
    gap = max(abs(resumed[s] - first["losses"][s]) / first["losses"][s] for s in steps)
    ok = sorted(resumed) == list(range(1, last + 1)) and gap <= tolerance
    s = resume_from + 1
    return row("train_resume", ok, f"from step {resume_from}: step {s} loss {resumed[s]:.4f} (uninterrupted "
               f"{first['losses'][s]:.4f}), max relative gap over steps {s}-{last} {gap:.1e}",
               f"<= {tolerance:g}, steps 1-{last} once each")


# ---------------------------------------------------------------------------------------------------- generation
def kv_cache_gap(ctx, model, prompt, autocast):
    """Greedy decode with the cache; max |cached - uncached| logits at every decoded position, and the sequence."""
    from nanochat.model.engine import Engine
    n_sup = model.config.n_sup_inference
    cache = Engine(model).new_cache(1, prompt.size(1) + ctx.sizes.decode_tokens, n_sup)
    with torch.inference_mode(), autocast:
        logits, seq, gap = model(prompt, kv_cache=cache)[:, -1], prompt, 0.0
        for _ in range(ctx.sizes.decode_tokens):
            gap = max(gap, (logits.float() - model(seq)[:, -1].float()).abs().max().item())
            token = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, token], dim=1)
            logits = model(token, kv_cache=cache)[:, -1]
    return gap, seq


def bf16_error(model, seq):
    """bf16's own error: max |uncached logits in bf16 - in float32| over the sequence."""
    with torch.inference_mode():
        exact = model(seq).float()
        with torch.autocast(seq.device.type, dtype=torch.bfloat16):
            return (model(seq).float() - exact).abs().max().item()


def check_kv_cache(ctx):
    from dev.bench_engine import random_model
    model = random_model(micro_step_config(ctx, plain=False), ctx.device)  # every weight random: logits differ
    prompt = torch.randint(0, model.config.vocab_size, (1, ctx.sizes.prompt_tokens), device=ctx.device)
    gap, seq = kv_cache_gap(ctx, model, prompt, ctx.autocast())
    if ctx.sizes.dtype == "float32":
        tolerance, why = 1e-4, "float32"
    else:  # the cache may differ from the full forward by rounding, no more than bf16 differs from float32
        tolerance, why = max(0.05, 2 * bf16_error(model, seq)), "2x bf16's own error"
    ctx.results["kv_cache"] = {"max_abs_gap": gap, "tolerance": tolerance}
    return row("kv_cache_logits", gap <= tolerance, f"max |cached - uncached| = {gap:.1e} over "
               f"{ctx.sizes.decode_tokens} decoded tokens ({ctx.sizes.dtype})", f"<= {tolerance:.1e} ({why})")


def check_decode(ctx):
    from dev.bench_engine import random_model
    from nanochat.model.engine import Engine
    model = random_model(micro_step_config(ctx, plain=False), ctx.device)
    prompt = torch.randint(0, model.config.vocab_size, (ctx.sizes.prompt_tokens,)).tolist()
    engine = Engine(model)
    with ctx.autocast():
        engine.generate_batch([prompt], max_tokens=2, temperature=0, stop_tokens=set())  # warm up
        engine.generate_batch([prompt], max_tokens=ctx.sizes.decode_tokens, temperature=0, stop_tokens=set())
    tok_per_s = engine.stats["decode_tokens"] / engine.stats["decode_s"]
    ctx.results["decode"] = {**engine.stats, "tok_per_s": tok_per_s}
    return row("decode", tok_per_s > 0, f"{tok_per_s:,.1f} tok/s (batch 1, prompt {len(prompt)}, "
               f"n_sup {model.config.n_sup_inference}, KV cache)", "measured")


# ---------------------------------------------------------------------------------------------------- export
def check_export_hf(ctx):
    if ctx.results.get("train") is None:
        raise RuntimeError("needs train_run's checkpoint, and train_run failed")
    from transformers import AutoModelForCausalLM

    from nanochat.checkpoint.manager import load_model
    from scripts import export_hf
    out = os.path.join(ctx.work, "export_hf")
    if export_hf.main(["--model_tag", MODEL_TAG, "--out", out, "--force"]) != 0:
        raise RuntimeError("scripts/export_hf.py failed (see its error above)")
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).to(ctx.device).eval()
    ours = load_model(MODEL_TAG, "latest", ctx.device)[0]
    idx = torch.randint(0, ours.config.vocab_size, (2, ours.config.sequence_len), device=ctx.device)
    with torch.no_grad():
        gap = (hf(idx).logits - ours(idx)).abs().max().item()
    return row("export_hf", gap <= 1e-4, f"max |transformers - ours| logits = {gap:.1e} (float32)", "<= 1e-4")


# ---------------------------------------------------------------------------------------------------- the report
CHECKS = [check_environment, check_peak_flops, check_torch_lock, check_allocator, check_attention, check_kv_cache_dtype,
          check_tiny_compile, check_plain, check_nanochat, check_trm, check_trm_bf16_state, check_train_run,
          check_train_resume, check_kv_cache, check_decode, check_export_hf]
# The 5-minute kit (the GPU machine lent for ~15 minutes): the facts and the three steps; nothing trains a tokenizer
QUICK = [check_environment, check_peak_flops, check_torch_lock, check_allocator, check_attention,
         check_kv_cache_dtype, check_plain, check_nanochat, check_trm, check_trm_bf16_state]


def run_check(check, ctx):
    """The check's rows; an exception (a sys.exit too) becomes one failed row with its one-line error."""
    name = check.__name__.removeprefix("check_")
    t0 = time.perf_counter()
    try:
        rows = check(ctx)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a failing check must not stop the others
        rows = row(name, False, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                   "runs")
    rows = rows if isinstance(rows, list) else [rows]
    for r in rows:
        print(f"[{'ok' if r['ok'] else 'FAIL':>4}] {r['name']}: {r['value']}", flush=True)
    seconds = time.perf_counter() - t0
    print(f"       ({name}: {seconds:.1f} s)", flush=True)
    ctx.results.setdefault("check_seconds", {})[name] = round(seconds, 2)
    return rows


def markdown(report):
    env = report["environment"]
    lines = [f"# GPU check: {env.get('device')} ({report['device_type']}), {report['created']}", "",
             "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"{sum(r['ok'] for r in report['checks'])}/{len(report['checks'])} checks passed in "
             f"{report['wall_s']:.0f} s{' (--quick)' if report.get('quick') else ''}.", "",
             "| check | ok | value | expected |", "|---|---|---|---|"]
    cell = lambda text: str(text).replace("|", "\\|").replace("\n", " ")  # noqa: E731 - a | would end the cell
    lines += [f"| {r['name']} | {'ok' if r['ok'] else 'FAIL'} | {cell(r['value'])} | {cell(r['expected'])} |"
              for r in report["checks"]]
    return "\n".join(lines) + "\n"


def write_report(out, report):
    atomic_write_bytes(os.path.join(out, "report.json"), json.dumps(report, indent=2, default=str).encode())
    text = markdown(report)
    atomic_write_bytes(os.path.join(out, "report.md"), text.encode())
    return text


def default_out(device):
    if device.type != "cuda":
        return tempfile.mkdtemp(prefix="gpu_check-")
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return os.path.join(ROOT, "dev", "results", "gpu", f"{datetime.date.today().isoformat()}-{slug}")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m dev.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="directory for report.json, report.md and the run's files")
    parser.add_argument("--nanochat", default=None, metavar="DIR", help="a checkout of karpathy/nanochat to time")
    parser.add_argument("--quick", action="store_true", help="only the facts and the three steps (~5 min on one "
                        "H100): no tokenizer, training run, generation or export")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here; run on the GPU machine, or pass --device cpu")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out} is a file; give a directory (created if missing)")
    if args.nanochat and not os.path.isfile(os.path.join(args.nanochat, "nanochat", "gpt.py")):
        parser.error(f"--nanochat {args.nanochat}: no nanochat/gpt.py there; clone karpathy/nanochat and pass its "
                     f"directory")
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out = os.path.abspath(args.out or default_out(device))
    ctx = Context(device, SIZES[device.type], out, args.nanochat and os.path.abspath(args.nanochat))
    os.makedirs(ctx.base_dir, exist_ok=True)
    os.environ["NANOCHAT_BASE_DIR"] = ctx.base_dir  # in-process checkpoint loading reads it too
    os.environ["HF_MODULES_CACHE"] = os.path.join(ctx.work, "hf_modules")  # transformers' copy of the export's code
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # as base_train
    t0 = time.perf_counter()
    rows = [r for check in (QUICK if args.quick else CHECKS) for r in run_check(check, ctx)]
    report = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device_type": device.type, "wall_s": time.perf_counter() - t0, "checks": rows,
              "environment": ctx.results.get("environment") or {}, "measurements": ctx.results,
              "sizes": dataclasses.asdict(ctx.sizes), "quick": args.quick}
    passed = all(r["ok"] for r in rows)
    if passed:  # data shards and checkpoints have nothing to tell once everything passed
        shutil.rmtree(ctx.work, ignore_errors=True)
    print("\n" + write_report(out, report) + f"\nreport: {os.path.join(out, 'report.md')}, logs: "
          f"{os.path.join(out, 'logs')}" + ("" if passed else f", the runs' files: {ctx.work}"))
    return ExitCode.OK if passed else ExitCode.FAILED


if __name__ == "__main__":
    sys.exit(main())
