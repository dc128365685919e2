"""
The record of a run: metrics.jsonl (one JSON record per optimizer step, evaluation and sample), fanned out to wandb
and TensorBoard when asked for, GPU utilisation from NVML, the log line while training, and summary.json + report.md
at the end (the health warnings are nanochat/eval/health.py's).

summary.json and report.md are rebuilt from metrics.jsonl, so they cover the whole run however often it was resumed.
"""

import dataclasses
import datetime
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from nanochat.cli import missing_package
from nanochat.common import print0
from nanochat.eval.health import LossSmoother, smooth
from nanochat.eval.loss_eval import format_steps, refinement, step_name
from nanochat.files import WriteError, atomic_write_bytes, remove_stale_temporaries, writing
from nanochat.train.flops import estimate_flops

GPU_READ_EVERY_S = 10.0  # NVML readings (3 calls per GPU) at most this often: a step's log line needs no fresher ones
COMPILE_STEPS = 10  # the first steps of a process compile and warm up: left out of the mean step time
# What to do once a failed write of the run's record is fixed: the checkpoints are written apart from it
RESUME_HINT = ", then run the same command with --resume (the checkpoints saved so far are intact)"


class MetricsError(ValueError):
    """metrics.jsonl is missing or unreadable; the message names the file and line."""


# ---------------------------------------------------------------------------------------------------- reading
def summary_path(run_dir):
    """The run's summary.json: written by write_summary, read by the launcher's checks and by compare."""
    return os.path.join(run_dir, "summary.json")


def read_records(path):
    """Every record of a metrics.jsonl, in file order.

    A torn last line (the writer was killed, lost power or ran out of disk mid-line) is dropped with a warning; a bad
    line before the last one means the file was damaged some other way: an error naming the file and line.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not (isinstance(record, dict) and "kind" in record and "step" in record):
                raise ValueError("not a record with 'kind' and 'step'")
        except ValueError as e:
            if i == len(lines) - 1:
                print(f"WARNING: {path} line {n} is cut off (the run was interrupted while writing it); "
                      f"ignoring it", file=sys.stderr, flush=True)
                break
            raise MetricsError(f"{path} line {n} is not a valid record ({e}): repair or delete that line")
        records.append(record)
    return records


def read_metrics(run_dir):
    """{"train": [...], "eval": [...], "sample": [...]}, each sorted by optimizer step, the last record per step
    (a resumed run logs the step it resumed at again)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise MetricsError(f"no metrics.jsonl in {run_dir}; is this a run directory or model tag?")
    latest = {(r["kind"], r["step"]): r for r in read_records(path)}
    by_kind = {"train": [], "eval": [], "sample": []}
    for (kind, _), record in sorted(latest.items(), key=lambda item: item[0][1]):
        by_kind.setdefault(kind, []).append(record)
    return by_kind


def format_duration(seconds):
    if seconds < 90:
        return f"{seconds:.0f}s"
    return f"{seconds / 3600:.1f}h" if seconds > 5400 else f"{seconds / 60:.1f}m"


def json_safe(value):
    """NaN and infinities become null: JSON has no NaN, and a reader of summary.json must never choke on one."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def scalars(record):
    """The numbers of a record for dashboards: lists become name/0, name/1, ... (supervision steps, GPUs)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            out[f"{record['kind']}/{key}"] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{record['kind']}/{key}/{i}": v for i, v in enumerate(value)})
    return out


# ---------------------------------------------------------------------------------------------------- sinks
class WandbSink:
    def __init__(self, name, config):
        import wandb  # lazy: the optional wandb extra, needed only with --run
        self.run = wandb.init(project="nanochat-trm", name=name, config=json_safe(config), resume="allow")

    def log(self, values, step):
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


class TensorBoardSink:
    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter  # lazy: needs the optional tensorboard package
        self.writer = SummaryWriter(log_dir, flush_secs=10)
        print0(f"TensorBoard: tensorboard --logdir {log_dir}")

    def log(self, values, step):
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def close(self):
        self.writer.close()


def visible_gpus(count):
    """NVML indices of the GPUs this job may use: CUDA_VISIBLE_DEVICES when it lists indices, else all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    indices = [int(i) for i in visible.split(",") if i.strip().isdigit()]
    return [i for i in indices if i < count] if indices else list(range(count))


class GpuMonitor:
    """Utilisation (%), memory in use (GB) and temperature (C) of this node's GPUs, through NVML (nvidia-ml-py)."""

    def __init__(self):
        import pynvml  # lazy: the optional nvidia-ml-py, on CUDA runs only
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in visible_gpus(pynvml.nvmlDeviceGetCount())]

    def read(self):
        nvml = self.nvml
        return {"gpu_util_pct": [nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in self.handles],
                "gpu_mem_gb": [nvml.nvmlDeviceGetMemoryInfo(h).used / 1e9 for h in self.handles],
                "gpu_temp_c": [nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU) for h in self.handles]}

    def close(self):
        self.nvml.nvmlShutdown()


def open_optional(name, make):
    """A monitor the run can live without: a failure to start it is a warning, never the end of a paid run."""
    try:
        return make()
    except ModuleNotFoundError as e:  # its optional package: the line says which extra brings it
        print0(f"WARNING: {name} is off: {missing_package(e, name)}; metrics.jsonl has everything")
    except Exception as e:  # noqa: BLE001 - e.g. wandb not logged in, no NVIDIA driver
        print0(f"WARNING: {name} is off ({type(e).__name__}: {e}); metrics.jsonl has everything")
    return None


# ---------------------------------------------------------------------------------------------------- the log
class MetricsLog:
    """metrics.jsonl beside the checkpoints, and the same records to wandb (--run) and TensorBoard (--tensorboard).

    Rank 0 writes; every rank keeps the smoothed loss and step times for the log line (printed by rank 0 only).
    A write that fails during the run is kept in `failure` (its one-line message), not raised, so that every rank
    stops together at the next agreement (base_train): rank 0 alone leaving would strand the others in a collective.
    """

    def __init__(self, run_dir, run_config, rank, resume_step):
        """run_config: the run's train_config.RunConfig (--run, --tensorboard, the device)."""
        self.path, self.enabled, self.sinks, self.gpus = os.path.join(run_dir, "metrics.jsonl"), rank == 0, [], None
        self.failure, self.gpus_read_at = None, -math.inf
        self.smoother, self.step_times = LossSmoother(), []  # step_times: this process's, for the ETA
        if not self.enabled:
            return
        run_files = os.path.join(glob.escape(run_dir), "*")
        remove_stale_temporaries(run_files, os.path.join(run_files, "*"))  # a step's meta.json is rewritten too
        if resume_step is not None and os.path.exists(self.path):  # drop what the run logged past its checkpoint
            kept = [r for r in read_records(self.path) if r["step"] <= resume_step]
            atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode(), RESUME_HINT)
            train = [r for r in kept if r["kind"] == "train"]
            for r in train:
                self.smoother.update(r["step_losses"])
        elif resume_step is None and os.path.exists(self.path):
            with writing(self.path, RESUME_HINT):
                os.remove(self.path)
        if run_config.wandb_run != "dummy":
            self.sinks.append(open_optional("wandb", lambda: WandbSink(run_config.wandb_run,
                                                                       dataclasses.asdict(run_config))))
        if run_config.tensorboard is not None:
            self.sinks.append(open_optional("TensorBoard", lambda: TensorBoardSink(
                run_config.tensorboard or os.path.join(run_dir, "tensorboard"))))
        if run_config.device_type == "cuda":
            self.gpus = open_optional("GPU monitoring", GpuMonitor)
        self.sinks = [s for s in self.sinks if s]

    def log(self, record):
        if record["kind"] == "train":
            self.smoother.update(record["step_losses"])
            self.step_times.append(record["dt"])
            if self.gpus and time.monotonic() - self.gpus_read_at >= GPU_READ_EVERY_S:
                self.gpus_read_at = time.monotonic()
                record = {**record, **self.read_gpus()}
        if not self.enabled:
            return
        self.attempt(lambda: self.append(record))
        for sink in list(self.sinks):
            try:
                sink.log(scalars(record), record["step"])
            except Exception as e:  # noqa: BLE001 - a dashboard outage must not stop training
                print0(f"WARNING: {type(sink).__name__} failed ({type(e).__name__}: {e}); it is off from now on")
                self.sinks.remove(sink)

    def append(self, record):
        with writing(self.path, RESUME_HINT), open(self.path, "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")

    def attempt(self, write):
        """Run one of the run's writes (the log, a checkpoint's bpb, the summary); keep the first WriteError's message
        (not the exception: its traceback would keep the run's frames alive). After one failed, the others are not
        tried: the disk that refused one refuses the next."""
        if self.failure is None:
            try:
                write()
            except WriteError as e:
                self.failure = str(e)

    def read_gpus(self):
        try:
            return self.gpus.read()
        except Exception as e:  # noqa: BLE001 - a GPU reading is a courtesy
            print0(f"WARNING: NVML reading failed ({type(e).__name__}: {e}); GPU monitoring is off from now on")
            self.gpus = None
            return {}

    def mean_step_time(self):
        """Mean seconds per optimizer step of this process, without its first (compiling) steps when there are more:
        a resumed run's earlier steps ran on another machine, load or thread count (dev/LOG.md, issue 58)."""
        settled = self.step_times[COMPILE_STEPS:]
        return statistics.mean(settled or self.step_times)

    def format_step(self, record, num_iterations):
        """The training log line (docs/training-log.md)."""
        step, losses, mfu, mem = record["step"], record["step_losses"], record["mfu"], record["peak_mem_gb"]
        eta = (num_iterations - step) * self.mean_step_time()
        return (f"step {step:05d}/{num_iterations} ({100 * step / num_iterations:.1f}%) | loss {losses[-1]:.4f} "
                f"(smooth {self.smoother.value[len(losses) - 1]:.4f}) | steps {format_steps(losses, digits=3)} | "
                f"refine {100 * record['refinement']:5.1f}% | gnorm {record['grad_norm']:.3f} | lrm "
                f"{record['lr_multiplier']:.2f} | {record['dt'] * 1000:.0f}ms | {record['tok_per_sec']:,.0f} tok/s | "
                f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem {'n/a' if mem is None else f'{mem:.1f}GB'}"
                f" | eta {format_duration(eta)}" + (f" | ${record['cost']:.2f}" if record["cost"] is not None else ""))

    def close(self):
        for sink in self.sinks:
            sink.close()
        if self.gpus:
            self.gpus.close()
        self.sinks, self.gpus = [], None


# ---------------------------------------------------------------------------------------------------- the report
def git_commit():
    """The commit of the checkout this code runs from ('unknown' outside one), noting uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30)
        if head.returncode:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def summarize(records, model_tag, step, seconds, price_per_hour, model, tokenizer_fingerprint):
    """summary.json's fields, from every record of the run (all resumes included)."""
    train, evals = records["train"], records["eval"]
    grad_norms = [r["grad_norm"] for r in train]
    final_eval = evals[-1] if evals else None
    smoothed = smooth([r["step_losses"] for r in train], 0.9)
    return json_safe({
        "model_tag": model_tag, "step": step,
        "val_bpb": final_eval and final_eval["val_bpb"], "val_step": final_eval and final_eval["step"],
        "val_refinement": final_eval and refinement(final_eval["val_bpb"]),
        "train_step_losses": train[-1]["step_losses"] if train else None,
        "train_step_losses_smoothed": smoothed[-1] if train else None,
        "train_refinement": refinement(train[-1]["step_losses"]) if train else None,
        "grad_norm_median_last": statistics.median(grad_norms[-max(1, len(grad_norms) // 10):]) if train else None,
        "grad_norm_max": max(grad_norms, default=None),
        "wall_time_s": seconds, "cost": seconds / 3600 * price_per_hour if price_per_hour else None,
        "parameters": model.num_params(), "flops_per_token": trained_flops_per_token(model, train),
        "tokenizer": tokenizer_fingerprint, "git_commit": git_commit()})


def trained_flops_per_token(model, train):
    """Training FLOPs per token of the steps the run trained, on average: each step's supervision steps as drawn (the
    length of its step_losses); the model's nominal step when none is recorded."""
    if not train:
        return estimate_flops(model)
    return statistics.fmean(estimate_flops(model, n_sup=len(r["step_losses"])) for r in train)


def write_summary(run_dir, run_config, step, seconds, price_per_hour, model, tokenizer_fingerprint):
    """summary.json for the launch scripts' success check, report.md for people; both from metrics.jsonl.
    run_config: the run's train_config.RunConfig."""
    records = read_metrics(run_dir)
    summary = summarize(records, run_config.model_tag, step, seconds, price_per_hour, model, tokenizer_fingerprint)
    atomic_write_bytes(summary_path(run_dir), json.dumps(summary, indent=2, allow_nan=False).encode(), RESUME_HINT)
    report = report_markdown(summary, records, run_config, model) + downstream_section(run_dir)
    atomic_write_bytes(os.path.join(run_dir, "report.md"), report.encode(), RESUME_HINT)
    print0(f"report: {os.path.join(run_dir, 'report.md')}")
    return summary


def report_markdown(summary, records, run_config, model):
    device = run_config.device_type
    if device == "cuda":
        device += f" ({torch.cuda.get_device_name()})"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# Run report: {run_config.model_tag}", "",
             f"- written: {date}",
             f"- git commit: {summary['git_commit']}",
             f"- tokenizer: {summary['tokenizer']} (fingerprint)",
             f"- system: {run_config.world_size} x {device}",
             f"- optimizer steps: {summary['step']}, wall time {format_duration(summary['wall_time_s'])}"
             + (f", cost ${summary['cost']:.2f}" if summary["cost"] is not None else ""),
             f"- parameters: {summary['parameters']:,}, FLOPs per token {summary['flops_per_token']:.3e}",
             f"- command line: {' '.join(run_config.argv)}", "", "## Config", "",
             *[f"- {k} = {v} ({run_config.config_sources.get(k, 'tokenizer')})"
               for k, v in model.config.to_dict().items()],
             "", "## Final loss per supervision step", "",
             f"Train: the last batch and its smoothed value; validation: bits per byte at optimizer step "
             f"{summary['val_step']}.", "",
             "| supervision step | train loss | train loss (smoothed) | val bpb |", "|---|---|---|---|"]
    cell = lambda values, s: f"{values[s]:.4f}" if values and s < len(values) else "-"
    for s in range(model.config.n_sup_train):
        lines.append(f"| {step_name(s)} | {cell(summary['train_step_losses'], s)} | "
                     f"{cell(summary['train_step_losses_smoothed'], s)} | {cell(summary['val_bpb'], s)} |")
    if summary["val_bpb"]:
        lines += ["", f"Validation refinement: {100 * summary['val_refinement']:.1f}%"]
    if records.get("probe"):
        lines += probe_section(records["probe"][-1])
    if summary["grad_norm_max"] is not None:
        lines += ["", f"Gradient norm: median {summary['grad_norm_median_last']:.3f} over the last 10% of optimizer "
                  f"steps, max {summary['grad_norm_max']:.3f}"]
    if records["sample"]:
        lines += ["", "## Samples (greedy)"]
        for r in records["sample"]:
            lines += ["", f"Optimizer step {r['step']}:", ""]
            lines += [f"- {prompt!r} -> {completion!r}" for prompt, completion in r["samples"]]
    return "\n".join(lines) + "\n"


def probe_section(probe):
    """The last depth probe (--probe=hops): accuracy by hop count at every supervision step."""
    lines = ["", f"## Depth probe: accuracy by hop count (optimizer step {probe['step']})", "",
             f"Chance {probe['chance']:.3f}; {sum(probe['answers']):,} answers in {probe['documents']:,} documents. "
             f"A recursion that uses its depth climbs down the long-hop columns.", "",
             "| supervision step | " + " | ".join(f"{h} hops" for h in probe["hops"]) + " |",
             "|---" * (len(probe["hops"]) + 1) + "|"]
    lines += [f"| {step_name(s)} | " + " | ".join(f"{v:.3f}" for v in row) + " |"
              for s, row in enumerate(probe["accuracy"])]
    return lines


# ---------------------------------------------------------------------------------------------------- base_eval
DOWNSTREAM_HEADING = "## Downstream tasks per supervision step (scripts.base_eval)"


def read_results(run_dir, script):
    """The run's results written by script (base_loss, base_eval: <script>_step*.json), by optimizer step."""
    results = []
    for path in sorted(glob.glob(os.path.join(run_dir, f"{script}_step*.json"))):
        with open(path) as f:
            results.append(json.load(f))
    return results


def downstream_section(run_dir):
    """report.md's last section: a table per evaluated checkpoint, metric by supervision steps run; '' if none."""
    lines = []
    for r in read_results(run_dir, "base_eval"):
        lines += ["", f"Checkpoint at optimizer step {r['step']}, trained with {r['n_sup_train']} supervision steps, "
                  f"lm-eval {r['lm_eval_version']}, limit {r['limit']}, few-shot {r['num_fewshot']}:", "",
                  "| task | metric | " + " | ".join(f"{s} steps" for s in range(1, r["n_sup"] + 1)) + " |",
                  "|---|---|" + "---|" * r["n_sup"]]
        for task, metrics in r["tasks"].items():
            lines += [f"| {task} | {metric} | " + " | ".join(f"{v:.4f}" for v in values) + " |"
                      for metric, values in metrics.items() if "stderr" not in metric]
    return "\n".join(["", DOWNSTREAM_HEADING] + lines) + "\n" if lines else ""


def refresh_downstream_section(run_dir):
    """Rewrite report.md's downstream section from the run's base_eval results (base_train keeps it when it
    rebuilds the report); returns report.md's path."""
    path = os.path.join(run_dir, "report.md")
    try:
        with open(path) as f:
            report = f.read().split("\n" + DOWNSTREAM_HEADING)[0]
    except FileNotFoundError:
        report = ""
    atomic_write_bytes(path, (report + downstream_section(run_dir)).encode())
    return path
