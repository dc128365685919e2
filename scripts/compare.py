"""
Does refinement pay? Train a grid of configurations on the same data, tokenizer, seed and data order, evaluate each on
the same validation tokens, and write a markdown table, a JSON file and plots to a results directory.

    python -m scripts.compare                                                    # CPU default grid, equal FLOPs
    python -m scripts.compare --mode=tokens --num_iterations=300 -- --depth=4 --n_embd=128 --max_seq_len=128
    torchrun --standalone --nproc_per_node=8 -m scripts.compare -- --target_flops=2e18 -- --depth=12

Budget modes:
    tokens   every config trains --num_iterations steps on the same batches
    flops    every config trains for the same training FLOPs: --target_flops, default --num_iterations steps of the
             costliest config; iterations come from each model's recursion-aware FLOPs per token (at the mean
             supervision steps it draws, nanochat/train/flops.py), so a plain model trains on proportionally more
             tokens (the same batches, in the same order, for longer)
    params   equal tokens, plus for each TRM config a plain model of the same width made deeper (or of the same depth
             made wider) until its FLOPs per token match the TRM's: same parameters vs same compute

Configs are --config NAME="base_train flags" (repeatable; default: --grid, below). Flags after a second `--` go to
base_train for every config (a config's own flags win); with none, on CPU the small default model below is used.
Every trained TRM model is then evaluated with 1 .. --inference_factor x n_sup_train supervision steps.
Finished configs are recorded in <out>/compare.json after each one, so a rerun skips them; a config interrupted
mid-training resumes from its last checkpoint (written every 5 minutes). On a shared CPU, OMP_NUM_THREADS=1 is often
several times faster than oversubscribed threads.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import argparse
import datetime
import hashlib
import json
import os
import socket
import sys
from dataclasses import dataclass, replace

import torch.distributed as dist

from nanochat import checkpoint as ckpt
from nanochat.cli import Exit, OneLineErrors, missing_package, underscore_flags
from nanochat.common import autodetect_device_type, compute_cleanup, compute_init, distributed, get_dist_info, print0
from nanochat.data.tokenizer import get_token_bytes, get_tokenizer
from nanochat.eval.loss_eval import format_steps, validation_bpb
from nanochat.eval.metrics import read_metrics, summary_path
from nanochat.files import atomic_write_bytes, exit_on_write_error, save_figure
from nanochat.model.supervision import STATE_DIAGNOSTICS
from nanochat.train import config as train_config
from nanochat.train import lifecycle, planning
from nanochat.train.config import batch_geometry, data_problem
from nanochat.train.flops import estimate_flops, run_flops_per_token
from nanochat.train.planning import PLAN_DRAWS, meta_model, model_config, num_iterations_for

DEFAULT_GRID = {
    "plain": "--n_loops=0 --n_sup_train=1",
    "trm_l1_s2": "--n_loops=1 --n_sup_train=2",
    "trm_l2_s4": "--n_loops=2 --n_sup_train=4",  # gpt.py's defaults with the aggressive preset (the guides' Phase 1)
    "trm_l2_s4_extreme": "--n_loops=2 --n_sup_train=4 --preset=extreme",  # the guides' "97% refinement" Phase 2
    # the recursion as it was before bounded states: the residual sum, no detach, no EMA
    "trm_l2_s4_residual": "--n_loops=2 --n_sup_train=4 --state_update=residual --detach_between_steps=false "
                          "--ema_decay=0",
}
# --grid=recursion: how the recursion writes its state, and the training options, each alone and combined, at equal
# compute (every config costs the same FLOPs per token); the first row is the recursion before bounded states.
RECURSION_GRID = {
    "residual": "--state_update=residual --detach_between_steps=false --ema_decay=0",
    "postnorm": "--state_update=postnorm --detach_between_steps=false --ema_decay=0",
    "decay": "--state_update=decay --detach_between_steps=false --ema_decay=0",
    "trm": "--state_update=trm --detach_between_steps=false --ema_decay=0",
    "trm_sampled": "--state_update=trm --detach_between_steps=false --ema_decay=0 --sample_n_sup",
    "trm_uniform": "--state_update=trm --detach_between_steps=false --ema_decay=0 --preset=uniform",
    "trm_ema": "--state_update=trm --detach_between_steps=false --ema_decay=auto",
    "trm_detach": "--state_update=trm --detach_between_steps=true --ema_decay=0",
    "trm_detach_ema": "--state_update=trm --detach_between_steps=true --ema_decay=auto",
}
# --grid=recipe: what paid in the looped-LM literature (issue 20), at equal parameters: four unique blocks each, as a
# plain GPT, as today's TRM (and with gradients through every step), or as a 2-layer recursion between a 1-block
# prelude and coda; then gradients through every step, sampled depth and the uniform preset added one at a time.
# --mode=params adds the equal-FLOPs plains.
RECIPE_CORE = "--depth=2 --n_prelude=1 --n_coda=1 --n_loops=2 --n_sup_train=4"
RECIPE_GRID = {
    "plain4": "--depth=4 --n_loops=0 --n_sup_train=1",
    "trm4": "--depth=4 --n_loops=2 --n_sup_train=4",
    "trm4_fullgrad": "--depth=4 --n_loops=2 --n_sup_train=4 --detach_between_steps=false",
    "trm2_pc": RECIPE_CORE,
    "trm2_pc_fullgrad": f"{RECIPE_CORE} --detach_between_steps=false",
    "trm2_pc_fullgrad_sampled": f"{RECIPE_CORE} --detach_between_steps=false --sample_n_sup",
    "trm2_pc_fullgrad_sampled_uniform": f"{RECIPE_CORE} --detach_between_steps=false --sample_n_sup --preset=uniform",
    "trm4_fullgrad_sampled_uniform": "--depth=4 --n_loops=2 --n_sup_train=4 --detach_between_steps=false "
                                     "--sample_n_sup --preset=uniform",
}
# --grid=depth: does depth pay on text, and does the recursion buy it (issue 32)? Plain GPTs of 4, 8 and 16 layers, the
# 4
# blocks simply looped 4 times (16 layers of compute) and gpt.py's default recursion, at equal tokens (--mode=tokens)
# and one width (set it in the shared flags); dev/depth_gpu.sh runs it on one GPU.
DEPTH_GRID = {
    "plain4": "--depth=4 --n_loops=0 --n_sup_train=1",
    "plain8": "--depth=8 --n_loops=0 --n_sup_train=1",
    "plain16": "--depth=16 --n_loops=0 --n_sup_train=1",
    "loop4x4": "--depth=4 --n_loops=0 --n_sup_train=4 --detach_between_steps=false --preset=uniform",
    "default4": "--depth=4",  # gpt.py's defaults, whatever they are
}
GRIDS = {"refinement": DEFAULT_GRID, "recursion": RECURSION_GRID, "recipe": RECIPE_GRID, "depth": DEPTH_GRID}
# Two layers, as in the TRM paper's tiny network; the default grid took 9 min on 2 shared CPU cores (OMP_NUM_THREADS=1).
CPU_MODEL = ["--depth=2", "--n_embd=128", "--n_head=2", "--max_seq_len=128", "--device_batch_size=8",
             "--eval_tokens=16384", "--sample_tokens=8", "--gradient_accumulation_steps=1"]
# Set by this script per config; a user value would silently break the comparison.
MANAGED = ("--num_iterations", "--target_flops", "--target_param_data_ratio", "--model_tag", "--resume",
           "--resume_from_step", "--eval_every", "--max_hours", "--max_cost")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # torchrun ... -m scripts.compare -- --mode=flops -- --depth=12
        argv = argv[1:]
    own, shared = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = OneLineErrors(prog="python -m scripts.compare", allow_abbrev=False, description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["tokens", "flops", "params"], default="flops", help="budget mode (see above)")
    p.add_argument("--config", action="append", default=None, metavar='NAME="FLAGS"', help="a config of the grid")
    p.add_argument("--grid", choices=GRIDS, default="refinement",
                   help="the configs when no --config is given: refinement (does it pay against plain GPTs), "
                        "recursion (state updates and training options at equal compute), recipe (prelude/coda, "
                        "full gradients, sampled depth at equal parameters) or depth (plain 4/8/16 layers against "
                        "the looped 4 and the default recursion, at equal tokens)")
    p.add_argument("--num_iterations", type=int, default=128,
                   help="steps of every config (tokens, params) or of the costliest config (flops)")
    p.add_argument("--target_flops", type=float, default=None, help="flops mode: training FLOPs of every config")
    p.add_argument("--match_by", choices=["depth", "width"], default="depth", help="params mode: how plain grows")
    p.add_argument("--evals", type=int, default=4, help="validation evals per run besides step 0")
    p.add_argument("--inference_factor", type=int, default=2, help="evaluate TRMs up to this x n_sup_train steps")
    p.add_argument("--out", default="compare_results", help="results directory")
    p.add_argument("--only", default=None, metavar="NAME,...",
                   help="train only these configs now (a part that fits a time limit); the table keeps every config "
                        "an earlier invocation finished")
    p.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect)")
    args = p.parse_args(own)
    args.argv = argv
    if args.num_iterations < 1 or args.evals < 1 or args.inference_factor < 1:
        p.error("--num_iterations, --evals and --inference_factor must be >= 1")
    if args.target_flops is not None and (args.mode != "flops" or args.target_flops <= 0):
        p.error("--target_flops is for --mode=flops and must be > 0")
    specs = args.config or [f"{name}={flags}" for name, flags in GRIDS[args.grid].items()]
    args.configs = []
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not name.isidentifier():
            p.error(f"--config {spec!r}: expected NAME=\"base_train flags\" with NAME a plain identifier")
        args.configs.append((name, flags.split()))
    names = [name for name, _ in args.configs]
    if len(set(names)) != len(names):
        p.error(f"config names must be unique, got {names}")
    args.only = args.only.split(",") if args.only else names
    if set(args.only) - set(names):
        p.error(f"--only {','.join(sorted(set(args.only) - set(names)))}: not a config of this comparison "
                f"({', '.join(names)})")
    args.device_type = args.device_type or autodetect_device_type()
    args.shared = shared or (CPU_MODEL if args.device_type == "cpu" else [])
    for flag in underscore_flags(args.shared + [f for _, flags in args.configs for f in flags]):
        if flag.split("=")[0] in MANAGED:
            p.error(f"{flag} is set by compare for each config; use compare's --mode/--num_iterations/--target_flops")
    return args


# ---------------------------------------------------------------------------------------------------- the plan
@dataclass
class Run:
    """One config of the comparison: its flags and parsed base_train arguments, its model on the meta device and
    counts; plan() fills in the budget (iterations, tokens, training FLOPs) and the base_train command and tag."""
    name: str
    flags: list
    run_config: train_config.RunConfig  # base_train's parsed flags
    model: object
    parameters: int
    flops_per_token: float  # training FLOPs per token at the mean supervision steps drawn (the run's, once planned)
    tokens_per_step: int
    matches: str | None = None  # params mode: the TRM config this plain model matches
    iterations: int | None = None
    tokens: int | None = None
    train_flops: float | None = None
    train_argv: list | None = None
    tag: str | None = None


def base_run_config(name, flags, world_size, vocab_size):
    """base_train's RunConfig for one config; bad flags exit naming the config."""
    try:
        return train_config.parse_args(flags, world_size=world_size, check_hardware=False, vocab_size=vocab_size)
    except SystemExit as e:
        raise Exit(f"compare: config {name}: {e}")


def is_trm(run_config):
    return run_config.model_config["n_loops"] > 0 or run_config.model_config["n_sup_train"] > 1


def make_run(name, flags, shared, vocab_size, world_size):
    run_config = base_run_config(name, shared + flags, world_size, vocab_size)
    model = meta_model(model_config(run_config, vocab_size))
    return Run(name, shared + flags, run_config, model, model.num_params(),
               run_flops_per_token(model, run_config.n_sup_warmup, PLAN_DRAWS), run_config.total_batch_size)


def matched_plain(trm, vocab_size, world_size, by):
    """The plain model of the TRM's width (depth) with more layers (heads) whose FLOPs per token come closest."""
    c, target = trm.run_config.model_config, trm.flops_per_token
    head_dim, group = c["n_embd"] // c["n_head"], c["n_head"] // c["n_kv_head"]
    best = None
    for k in range(1, 1024):  # wider = more heads of the same size, keeping the GQA grouping
        depth, kv_heads = (k, c["n_kv_head"]) if by == "depth" else (c["n_layer"], k)
        geometry = [f"--depth={depth}", f"--n_embd={kv_heads * group * head_dim}", f"--n_head={kv_heads * group}",
                    f"--n_kv_head={kv_heads}"]
        run = make_run(f"plain_{by[0]}{k}", trm.flags + geometry + ["--n_loops=0", "--n_sup_train=1",
                                                                       "--T_recursion=1"], [], vocab_size, world_size)
        if best is None or abs(run.flops_per_token - target) < abs(best.flops_per_token - target):
            best = run
        if run.flops_per_token >= target:
            break
    if abs(best.flops_per_token / target - 1) > 0.1:
        raise Exit(f"compare: no plain model within 10% of {trm.name}'s {target:.3e} FLOPs per token by "
                         f"{by} (closest {best.flops_per_token:.3e}); try --match_by="
                         f"{'width' if by == 'depth' else 'depth'}")
    best.matches = trm.name
    return best


def plan(args, vocab_size, world_size):
    """Every run of the comparison with its parameters, FLOPs per token, iterations, tokens and training FLOPs."""
    runs = [make_run(name, flags, args.shared, vocab_size, world_size) for name, flags in args.configs]
    given = {f.split("=")[0] for f in underscore_flags(args.shared)}
    if not given & {"--total_batch_size", "--gradient_accumulation_steps", "--device_batch_size"}:
        # base_train's automatic batch depends on the model: pin one batch, the reference total in the smallest
        # device batch that fits every config, so all of them see the same tokens in the same order
        args.shared = args.shared + [f"--total_batch_size={planning.B_REF}"]
        runs = [make_run(name, flags, args.shared, vocab_size, world_size) for name, flags in args.configs]
        args.shared.append(f"--device_batch_size={min(r.run_config.device_batch_size for r in runs)}")
        runs = [make_run(name, flags, args.shared, vocab_size, world_size) for name, flags in args.configs]
    elif "--device_batch_size" not in given and len({r.run_config.device_batch_size for r in runs}) > 1:
        # a pinned total or accumulation still leaves the device batch to each model's memory: take the smallest
        args.shared = args.shared + [f"--device_batch_size={min(r.run_config.device_batch_size for r in runs)}"]
        runs = [make_run(name, flags, args.shared, vocab_size, world_size) for name, flags in args.configs]
    data_order = {r.name: {**batch_geometry(r.run_config), "seed": r.run_config.seed} for r in runs}
    if len({json.dumps(v, sort_keys=True) for v in data_order.values()}) > 1:  # the batches depend on exactly these
        raise Exit("compare: every config must see the same tokens in the same order, so batch flags and "
                         "--seed belong after the second `--`, not in a config: " +
                         "; ".join(f"{name} {v}" for name, v in data_order.items()))
    if args.mode == "params":
        trms = [r for r in runs if is_trm(r.run_config)]
        if not trms:
            raise Exit("compare: --mode=params needs at least one TRM config to match")
        matched = {}
        for trm in trms:
            # match the FLOPs this run will spend: under the step-count curriculum its mean depends on its length
            iterations = num_iterations_for(replace(trm.run_config, num_iterations=args.num_iterations,
                                                    target_flops=None), trm.model)[0]
            trm.flops_per_token = run_flops_per_token(trm.model, trm.run_config.n_sup_warmup, iterations)
            run = matched_plain(trm, vocab_size, world_size, args.match_by)
            matched.setdefault(run.name, run)
        runs += matched.values()
    target = None
    if args.mode == "flops":
        target = args.target_flops or args.num_iterations * max(r.flops_per_token * r.tokens_per_step
                                                                for r in runs)
    for r in runs:
        horizon = (None, target) if target else (args.num_iterations, None)
        r.run_config = replace(r.run_config, num_iterations=horizon[0], target_flops=horizon[1])
        r.iterations = num_iterations_for(r.run_config, r.model)[0]
        r.flops_per_token = run_flops_per_token(r.model, r.run_config.n_sup_warmup, r.iterations)
        r.tokens = r.iterations * r.tokens_per_step
        r.train_flops = r.tokens * r.flops_per_token
        eval_every = max(1, r.iterations // args.evals)
        r.train_argv = r.flags + [f"--num_iterations={r.iterations}", f"--eval_every={eval_every}",
                                        "--save_every_minutes=5", "--keep_last=1", f"--device_type={args.device_type}"]
        # the tag names the exact training, so a changed config never resumes another's checkpoints
        r.tag = f"compare_{r.name}_{hashlib.sha1(' '.join(r.train_argv).encode()).hexdigest()[:8]}"
    return runs


# ---------------------------------------------------------------------------------------------------- one run
def train(run, world_size):
    argv = run.train_argv + [f"--model_tag={run.tag}"]
    steps = ckpt.list_steps(run.tag)
    if steps and steps[-1] == run.iterations:
        print0(f"{run.name}: training already finished, evaluating")
        return
    # an interrupted config resumes; one stopped before its first save starts over (its partial files moved aside)
    rc, received = run_base_train(argv + (["--resume"] if steps else ["--overwrite"]))
    if received:
        raise Exit(f"compare: stopped by {received.name} during {run.name}; run the same command again to "
                         f"continue where it stopped")
    if rc:
        raise Exit(f"compare: {run.name}: base_train failed with exit code {rc} (its message is above)")


def run_base_train(argv):
    """base_train in processes of its own, one per rank of this comparison: each config starts with a fresh
    torch._dynamo (its recompile limit would send later configs to eager mode) and frees its memory at exit.
    Under torchrun the children form their own process group on a port that rank 0 picks."""
    env = dict(os.environ)
    if distributed():
        port = [free_port() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(port, src=0)
        env["MASTER_PORT"] = str(port[0])
    return lifecycle.run_child([sys.executable, "-m", "scripts.base_train", *argv], env=env)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def inference_sweep(run, max_sup, device, rank, world_size):
    """Validation bpb after each of 1 .. max_sup supervision steps (a model's step s never depends on later steps)."""
    model, tokenizer, _ = ckpt.load_model(run.tag, run.iterations, device, n_sup_train=max_sup)
    bpb, state = validation_bpb(model, tokenizer, run.run_config, device, rank, world_size,
                                get_token_bytes(device=device))
    if bpb is None:
        raise Exit(f"compare: {run.name}: the inference evaluation failed (see the warning above)")
    return [{"n_sup": k + 1, "flops_per_token": estimate_flops(run.model, n_sup=k + 1, backward=False),
             "val_bpb": b, **dict(zip(STATE_DIAGNOSTICS, row))} for k, (b, row) in enumerate(zip(bpb, state))]


def result(run, inference):
    """The numbers of one finished run, from its metrics.jsonl and summary.json."""
    run_dir = ckpt.model_dir(run.tag)
    records = read_metrics(run_dir)
    train_records, evals = records["train"], records["eval"]
    with open(summary_path(run_dir)) as f:
        summary = json.load(f)
    tail = train_records[-max(1, len(train_records) // 10):]  # last 10% of training batches, smoothed
    final = evals[-1]["val_bpb"]
    trained = trained_flops(run, train_records)
    return {"name": run.name, "tag": run.tag, "flags": run.flags, "matches": run.matches,
            "model_config": run.run_config.model_config, "parameters": run.parameters,
            "flops_per_token": trained[-1][1] / run.tokens, "iterations": run.iterations, "tokens": run.tokens,
            "train_flops": trained[-1][1], "planned_train_flops": run.train_flops,
            "wall_time_s": summary["wall_time_s"],
            "val_bpb": final, "final_bpb": final[-1], "val_refinement": evals[-1]["val_refinement"],
            "train_refinement": sum(r["refinement"] for r in tail) / len(tail),
            "evals": [{"step": e["step"], "tokens": e["step"] * run.tokens_per_step,
                       "train_flops": flops_until(trained, e["step"]), "final_bpb": e["val_bpb"][-1]} for e in evals],
            "inference": inference}


def trained_flops(run, train_records):
    """[(step, training FLOPs up to it)], from each optimizer step's supervision steps as drawn (the length of its
    step_losses): what the run spent, where drawn step counts and the curriculum make it differ from the plan."""
    total, spent = 0.0, [(0, 0.0)]
    for r in train_records:
        total += estimate_flops(run.model, n_sup=len(r["step_losses"])) * run.tokens_per_step
        spent.append((r["step"], total))
    return spent


def flops_until(spent, step):
    """The training FLOPs spent before an evaluation at `step` (the last entry of `spent` at or before it)."""
    return max((flops for s, flops in spent if s <= step), default=0.0)


# ---------------------------------------------------------------------------------------------------- reporting
def human(x):
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def table(report):
    rows = ["| config | parameters | FLOPs/token | tokens seen | training FLOPs | wall time | val bpb per step | "
            "final bpb | val refinement | train refinement |", "|---" * 10 + "|"]
    for r in report["runs"]:
        name = r["name"] + (f" (≈ {r['matches']} FLOPs)" if r["matches"] else "")
        rows.append(f"| {name} | {r['parameters']:,} | {human(r['flops_per_token'])} | {human(r['tokens'])} | "
                    f"{human(r['train_flops'])} | {r['wall_time_s'] / 60:.1f} min | "
                    f"{format_steps(r['val_bpb'])} | **{r['final_bpb']:.4f}** | "
                    f"{100 * r['val_refinement']:.1f}% | {100 * r['train_refinement']:.1f}% |")
    rows += ["", "Validation bpb by supervision steps at inference (inference FLOPs per token in brackets; "
             "* = the steps the model was trained with):", "",
             "| config | " + " | ".join(f"n_sup={k}" for k in range(1, report["max_inference_sup"] + 1)) + " |",
             "|---" * (report["max_inference_sup"] + 1) + "|"]
    for r in report["runs"]:
        cells = [f"{i['val_bpb']:.4f}{'*' if i['n_sup'] == len(r['val_bpb']) else ''} ({human(i['flops_per_token'])})"
                 for i in r["inference"]]
        rows.append(f"| {r['name']} | " + " | ".join(cells + ["-"] * (report["max_inference_sup"] - len(cells))) + " |")
    rows += ["", "Does the recursion settle? Past the trained steps (N) a converging model's bpb stays flat and its "
             "state stops moving: RMS of the answer state y and of each step's update, at inference steps 1, N and 2N "
             "(first validation batch):", "",
             "| config | bpb(2N) - bpb(N) | best n_sup | rms y | rms update | cos(update, y) |", "|---" * 6 + "|"]
    for r in report["runs"]:
        inference, trained = r["inference"], len(r["val_bpb"])
        if len(inference) <= trained or "rms_y" not in inference[0]:
            continue
        at = [inference[0], inference[trained - 1], inference[-1]]
        arrow = lambda key, digits: " → ".join(f"{i[key]:.{digits}f}" for i in at)
        best = min(inference, key=lambda i: i["val_bpb"])["n_sup"]
        rows.append(f"| {r['name']} | {inference[-1]['val_bpb'] - inference[trained - 1]['val_bpb']:+.4f} | {best} | "
                    f"{arrow('rms_y', 2)} | {arrow('rms_update', 3)} | {arrow('cos_update_y', 2)} |")
    header = [f"Mode: **{report['mode']}**. Command: `{report['command']}` ({report['date']}, {report['device']}).",
              f"Wall time summed over runs (training and periodic evals): {report['wall_time_s'] / 60:.1f} min. "
              "FLOPs/token and training FLOPs count the supervision steps each optimizer step drew.", ""]
    return "\n".join(header + rows) + "\n"


def plot(report, out):
    try:
        import matplotlib  # lazy: the optional matplotlib (the 'plot' extra); missing, one line says so
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: after matplotlib.use, which must precede it
    except ImportError as e:
        raise Exit(missing_package(e, "compare's plot"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in report["runs"]:
        evals = r["evals"][1:]  # step 0 is the same untrained model for every config
        for ax, x in zip(axes, ("train_flops", "tokens")):
            ax.plot([e[x] for e in evals], [e["final_bpb"] for e in evals], marker="o", label=r["name"])
    axes[0].set(title="final-step validation bpb vs training FLOPs", xlabel="training FLOPs", ylabel="bpb")
    axes[1].set(title="final-step validation bpb vs tokens seen", xlabel="tokens", ylabel="bpb")
    finish(fig, axes, os.path.join(out, "bpb_vs_training.png"))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in report["runs"]:
        steps = [i["n_sup"] for i in r["inference"]]
        bpb = [i["val_bpb"] for i in r["inference"]]
        line, = axes[0].plot(steps, bpb, marker="o", label=r["name"])
        axes[1].plot([i["flops_per_token"] for i in r["inference"]], bpb, marker="o", label=r["name"])
        trained = len(r["val_bpb"]) - 1  # ring the step count the model was trained with
        axes[0].plot(steps[trained], bpb[trained], "o", ms=12, mfc="none", color=line.get_color())
    axes[0].set(title="validation bpb vs supervision steps at inference (ring = trained)", xlabel="n_sup",
                ylabel="bpb")
    axes[1].set(title="validation bpb vs inference FLOPs per token", xlabel="FLOPs per token", ylabel="bpb",
                xscale="log")
    finish(fig, axes, os.path.join(out, "bpb_vs_inference.png"))
    plt.close("all")


def finish(fig, axes, path):
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def write_report(report, out):
    atomic_write_bytes(os.path.join(out, "compare.json"), json.dumps(report, indent=2).encode())
    atomic_write_bytes(os.path.join(out, "compare.md"), table(report).encode())
    plot(report, out)


# ---------------------------------------------------------------------------------------------------- the story
def main(argv=None):
    args = parse_args(argv)
    world_size = get_dist_info()[3]
    missing = data_problem()
    if missing:
        raise Exit(f"compare: {missing}")
    runs = plan(args, get_tokenizer().get_vocab_size(), world_size)
    _, rank, _, _, device = compute_init(args.device_type)
    path = os.path.join(args.out, "compare.json")
    done = {}
    if os.path.exists(path):
        with open(path) as f:
            done = {r["tag"]: r for r in json.load(f)["runs"]}
    print0(f"compare ({args.mode} mode): {len(runs)} runs, {sum(r.train_flops for r in runs):.3e} training FLOPs")
    for r in runs:
        print0(f"  {r.name:22s} {r.parameters:>12,} params  {r.flops_per_token:.3e} FLOPs/token  "
               f"{r.iterations:>6} steps  {human(r.tokens):>7} tokens  {r.train_flops:.3e} FLOPs"
               + ("  (done)" if r.tag in done else ""))
    os.makedirs(args.out, exist_ok=True)
    report = {"mode": args.mode, "command": " ".join(["python -m scripts.compare"] + args.argv),
              "date": datetime.date.today().isoformat(), "device": f"{world_size} x {args.device_type}",
              "wall_time_s": 0.0, "max_inference_sup": 1, "runs": []}
    for i, run in enumerate(runs):
        if run.tag in done:
            print0(f"[{i + 1}/{len(runs)}] {run.name}: finished in an earlier invocation, skipping")
            report["runs"].append(done[run.tag])
        elif run.name not in args.only:
            print0(f"[{i + 1}/{len(runs)}] {run.name}: not in --only, left for another invocation")
            continue
        else:
            print0(f"[{i + 1}/{len(runs)}] {run.name}: training {run.iterations} steps ({run.tag})")
            train(run, world_size)
            n_sup = run.run_config.model_config["n_sup_train"]
            max_sup = n_sup * args.inference_factor if is_trm(run.run_config) else 1  # a plain stack is no refiner
            print0(f"[{i + 1}/{len(runs)}] {run.name}: validation bpb for 1..{max_sup} supervision steps")
            report["runs"].append(result(run, inference_sweep(run, max_sup, device, rank, world_size)))
        report["wall_time_s"] = sum(r["wall_time_s"] for r in report["runs"])
        report["max_inference_sup"] = max(len(r["inference"]) for r in report["runs"])
        if rank == 0:  # after every run, with the later runs an earlier invocation finished: a rerun skips them all
            later = [done[r.tag] for r in runs[i + 1:] if r.tag in done]
            with exit_on_write_error("compare"):
                write_report({**report, "runs": report["runs"] + later}, args.out)
    print0(table(report))
    print0(f"results: {os.path.abspath(args.out)}")
    compute_cleanup()


if __name__ == "__main__":
    main()
