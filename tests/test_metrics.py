"""nanochat/eval/metrics.py: reading metrics.jsonl, the log line, the sinks (wandb, TensorBoard, NVML), summary,
report."""

import json
import os
import subprocess
import sys
import types
from argparse import Namespace

import pytest

from nanochat.cli import install_command
from nanochat.eval import metrics
from nanochat.eval.metrics import MetricsError, MetricsLog, read_metrics, read_records
from nanochat.train import config as train_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--n_loops=1",
        "--n_sup_train=2", "--eval_tokens=256", "--eval_every=4", "--sample_every=4", "--sample_tokens=4",
        "--device_type=cpu", "--warmup_steps=1", "--gradient_accumulation_steps=1", "--num_iterations=8",
        "--save_every=4", "--sample_n_sup=false", "--n_sup_warmup=0"]  # a fixed depth: n_sup_train steps a record
TORN = '{"kind": "train", "step": 9, "loss": 3.1'  # what a kill in the middle of a write leaves


def train_record(step, losses, dt=1.0):
    return {"kind": "train", "step": step, "loss": losses[-1], "step_losses": losses, "refinement": 0.0,
            "grad_norm": 1.0, "lr_multiplier": 1.0, "dt": dt, "tok_per_sec": 100.0, "mfu": None,
            "peak_mem_gb": None, "cost": None}


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines[:-1]) + lines[-1])


def local_args(**kw):
    return Namespace(**{"wandb_run": "dummy", "tensorboard": None, "device_type": "cpu", **kw})


# ---------------------------------------------------------------------------------------------------- reading
@pytest.mark.parametrize("torn", [TORN, "\x00\x00\x00\x00", '{"kind": "eval"'])
def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, capsys, torn):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [json.dumps(train_record(1, [3.0, 2.9])), json.dumps(train_record(2, [2.8, 2.7])), torn])
    assert [r["step"] for r in read_records(path)] == [1, 2]
    assert f"{path} line 3 is cut off" in capsys.readouterr().err


def test_a_bad_line_in_the_middle_is_an_error_naming_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [json.dumps(train_record(1, [3.0])), TORN, json.dumps(train_record(2, [2.8])), ""])
    with pytest.raises(MetricsError, match=f"{path} line 2 is not a valid record"):
        read_records(path)


def test_read_metrics_keeps_the_last_record_of_a_step_logged_twice(tmp_path):
    write_lines(tmp_path / "metrics.jsonl", [json.dumps(train_record(2, [9.0])), json.dumps(train_record(1, [3.0])),
                                             json.dumps(train_record(2, [2.0])), ""])
    assert [r["step_losses"] for r in read_metrics(tmp_path)["train"]] == [[3.0], [2.0]]
    with pytest.raises(MetricsError, match="no metrics.jsonl in"):
        read_metrics(tmp_path / "elsewhere")


# ---------------------------------------------------------------------------------------------------- the log line
def test_the_log_line_shows_a_debiased_smoothed_loss_and_an_eta_from_the_mean_step_time(tmp_path):
    metrics = MetricsLog(str(tmp_path), local_args(), rank=0, resume_step=None)
    line = None
    for step in range(1, 16):  # 10 slow compiling steps of 60 s, then 5 of 2 s
        record = train_record(step, [5.0, 4.0 if step == 1 else 2.0], dt=60.0 if step <= 10 else 2.0)
        metrics.log(record)
        line = metrics.format_step(record, num_iterations=115)
    smooth = 0.1 * sum(0.9 ** k * 2.0 for k in range(14)) + 0.1 * 0.9 ** 14 * 4.0
    smooth /= 1 - 0.9 ** 15  # nanochat's bias correction
    assert f"loss 2.0000 (smooth {smooth:.4f})" in line
    assert "eta 3.3m" in line  # 100 steps left x 2 s: the compiling steps are left out of the mean
    assert line.startswith("step 00015/115 (13.0%) | ")


def test_eta_before_the_compiling_steps_are_over_uses_what_there_is(tmp_path):
    metrics = MetricsLog(str(tmp_path), local_args(), rank=0, resume_step=None)
    for step, dt in enumerate([30.0, 10.0], 1):
        metrics.log(train_record(step, [3.0], dt=dt))
    assert "eta 40.0m" in metrics.format_step(train_record(2, [3.0]), 122)  # 120 steps x mean(30, 10) s


def test_eta_after_a_resume_comes_from_this_processs_steps_only(tmp_path):
    """The issue's resume: the first process ran 35 s steps beside other work, this one runs 8 s steps; the ETA of
    its first step reads 8 s a step, not the earlier ones' (77.6 min where 13.7 min was true)."""
    first = MetricsLog(str(tmp_path), local_args(), rank=0, resume_step=None)
    for step in range(1, 21):
        first.log(train_record(step, [3.0], dt=35.0))
    resumed = MetricsLog(str(tmp_path), local_args(), rank=0, resume_step=20)
    record = train_record(21, [3.0], dt=8.0)
    resumed.log(record)
    assert "eta 13.2m" in resumed.format_step(record, num_iterations=120)  # 99 steps left x 8 s


# ---------------------------------------------------------------------------------------------------- sinks
class FakeNVML(types.ModuleType):
    """pynvml as nvidia-ml-py provides it, for two GPUs with fixed readings."""
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        super().__init__("pynvml")
        self.shutdown = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shutdown = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return Namespace(gpu=[97, 42][h], memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):
        return Namespace(used=[60e9, 1.5e9][h], total=80e9, free=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == self.NVML_TEMPERATURE_GPU
        return [71, 38][h]


def test_the_nvml_monitor_writes_gpu_utilisation_memory_and_temperature(tmp_path, monkeypatch):
    nvml = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    metrics = MetricsLog(str(tmp_path), local_args(device_type="cuda"), rank=0, resume_step=None)
    metrics.log(train_record(1, [3.0]))
    metrics.log({"kind": "eval", "step": 1, "val_bpb": [1.5]})
    metrics.close()
    train, evals = read_metrics(tmp_path)["train"], read_metrics(tmp_path)["eval"]
    assert (train[0]["gpu_util_pct"], train[0]["gpu_mem_gb"], train[0]["gpu_temp_c"]) == ([97, 42], [60.0, 1.5],
                                                                                          [71, 38])
    assert "gpu_util_pct" not in evals[0] and nvml.shutdown
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # this job's GPU only
    metrics = MetricsLog(str(tmp_path), local_args(device_type="cuda"), rank=0, resume_step=1)
    metrics.log(train_record(2, [3.0]))
    metrics.log(train_record(3, [3.0]))  # within GPU_READ_EVERY_S of the last reading: NVML is not asked again
    assert [r.get("gpu_temp_c") for r in read_metrics(tmp_path)["train"][-2:]] == [[38], None]



def test_without_nvml_the_run_logs_without_gpu_fields(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    metrics = MetricsLog(str(tmp_path), local_args(device_type="cuda"), rank=0, resume_step=None)
    metrics.log(train_record(1, [3.0]))
    assert "GPU monitoring is off: GPU monitoring needs pynvml, which is not installed; install it with: " \
        f"{install_command('gpu')}; metrics.jsonl has everything" in capsys.readouterr().out
    assert "gpu_util_pct" not in read_metrics(tmp_path)["train"][0]


class FakeWandb(types.ModuleType):
    def __init__(self, fail=None):
        super().__init__("wandb")
        self.fail, self.inits, self.logged, self.finished = fail, [], [], False

    def init(self, **kwargs):
        if self.fail:
            raise self.fail
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_gets_the_same_records_as_the_file_under_the_wandb_run_name(tmp_path, monkeypatch):
    from nanochat.train.config import parse_args
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_RUN", "my_run")
    run_config = parse_args(["--device_type=cpu", "--depth=1", "--max_seq_len=32", "--device_batch_size=2"])
    metrics = MetricsLog(str(tmp_path), run_config, rank=0, resume_step=None)
    metrics.log(train_record(1, [3.0, 2.5]))
    metrics.log({"kind": "eval", "step": 1, "val_bpb": [1.5, 1.4], "val_refinement": 0.07})
    metrics.close()
    assert wandb.inits[0]["name"] == "my_run" and wandb.finished
    assert wandb.logged[0][0] == 1 and wandb.logged[0][1]["train/step_losses/1"] == 2.5
    assert wandb.logged[1] == (1, {"eval/val_bpb/0": 1.5, "eval/val_bpb/1": 1.4, "eval/val_refinement": 0.07})


def test_wandb_not_logged_in_warns_and_tensorboard_gets_the_run(base_dir, monkeypatch, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=RuntimeError("api_key not configured (no-tty)")))
    flags = [f for f in TINY if not f.startswith(("--num_iterations", "--save_every"))]
    base_train.main(flags + ["--num_iterations=2", "--run=offline", f"--tensorboard={tmp_path}", "--model_tag=sinks"])
    out = capsys.readouterr().out
    assert "WARNING: wandb is off (RuntimeError: api_key not configured (no-tty))" in out
    assert "report: " in out  # the run went on to the end
    assert [r["step"] for r in read_metrics(os.path.join(base_dir, "base_checkpoints", "sinks"))["train"]] == [1, 2]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/step_losses/0", "train/step_losses/1", "train/grad_norm", "eval/val_bpb/1"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]


def test_tensorboard_without_the_package_is_refused_before_anything_runs(monkeypatch):
    monkeypatch.setattr(train_config.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"--tensorboard needs tensorboard, which is not installed; install it with: "
                                         r".* -m pip install -e '.*\[tensorboard\]'"):
        train_config.parse_args(["--device_type=cpu", "--depth=4", "--tensorboard"])  # a model any CPU's RAM fits


# ---------------------------------------------------------------------------------------------------- the summary
def summary(base_dir, tag):
    """summary.json, strictly parsed (no NaN), less the fields that are not the run's results: its name, and the wall
    time and cost, which honestly include the evaluation a resumed run repeats."""
    with open(os.path.join(base_dir, "base_checkpoints", tag, "summary.json")) as f:
        s = json.loads(f.read(), parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))
    assert s["wall_time_s"] > 0
    return {k: v for k, v in s.items() if k not in ("model_tag", "wall_time_s", "cost")}


def test_summary_covers_the_whole_run_across_a_crash_a_torn_line_and_a_resume_of_the_finished_run(
        base_dir, monkeypatch, capsys):
    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    base_train.main(TINY + ["--model_tag=whole"])
    first = summary(base_dir, "whole")
    assert first["grad_norm_max"] > 0 and len(first["train_step_losses"]) == 2 and first["val_step"] == 8

    class Crash(Exception):
        pass

    def dies_writing_step_6(self, record):  # the process dies halfway through writing step 6's record
        if record["kind"] == "train" and record["step"] == 6:
            with open(self.path, "a") as f:
                f.write(TORN)
            raise Crash
        real_log(self, record)

    real_log = MetricsLog.log
    monkeypatch.setattr(MetricsLog, "log", dies_writing_step_6)
    with pytest.raises(Crash):
        base_train.main(TINY + ["--model_tag=parts"])
    monkeypatch.setattr(MetricsLog, "log", real_log)
    capsys.readouterr()
    base_train.main(TINY + ["--model_tag=parts", "--resume"])
    out, err = capsys.readouterr()
    assert "resumed parts from step 4" in out and "is cut off" in err
    assert summary(base_dir, "parts") == first  # gradient norms of steps 1-8, not only 5-8

    # --resume of the finished run: summary unchanged (was: train_step_losses null and NaN)
    with open(os.path.join(base_dir, "base_checkpoints", "whole", "metrics.jsonl"), "a") as f:
        f.write(TORN)
    base_train.main(TINY + ["--model_tag=whole", "--resume"])
    assert summary(base_dir, "whole") == first
    for tag in ("whole", "parts"):  # the torn lines are gone from the files
        with open(os.path.join(base_dir, "base_checkpoints", tag, "metrics.jsonl")) as f:
            lines = f.read().split("\n")
        assert lines[-1] == "" and all(json.loads(line) for line in lines[:-1])

    # the report of the run: date, commit, tokenizer, and the samples printed during training
    from nanochat.data.tokenizer import get_tokenizer
    with open(os.path.join(base_dir, "base_checkpoints", "whole", "report.md")) as f:
        text = f.read()
    assert f"- tokenizer: {get_tokenizer().fingerprint()}" in text
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert f"- git commit: {commit or 'unknown'}" in text
    assert "- written: 20" in text and " UTC" in text
    samples = read_metrics(os.path.join(base_dir, "base_checkpoints", "whole"))["sample"]
    assert [r["step"] for r in samples] == [0, 4, 8]
    for r in samples:
        assert f"Optimizer step {r['step']}:" in text
        assert all(f"- {prompt!r} -> {completion!r}" in text for prompt, completion in r["samples"])


def test_git_commit_is_unknown_outside_a_checkout(monkeypatch):
    def no_git(*a, **k):
        raise FileNotFoundError("git")
    monkeypatch.setattr(metrics.subprocess, "run", no_git)
    assert metrics.git_commit() == "unknown"


def test_a_summary_without_steps_or_evaluations_is_valid_json(monkeypatch):
    monkeypatch.setattr(metrics, "estimate_flops", lambda model, n_sup=None: 60)
    model = Namespace(num_params=lambda: 10)
    s = metrics.summarize({"train": [], "eval": [], "sample": []}, "t", 0, float("nan"), 0, model, "abc")
    text = json.dumps(s, allow_nan=False)
    assert json.loads(text)["grad_norm_median_last"] is None and json.loads(text)["wall_time_s"] is None


def test_the_summarys_flops_per_token_are_the_mean_of_the_steps_drawn():
    # a run of drawn step counts (1 and 3 supervision steps here) spent the FLOPs of what it drew, not n_sup_train's
    from nanochat.model.gpt import GPT
    from nanochat.train.flops import estimate_flops
    from tests.support.helpers import tiny_config
    model = GPT(tiny_config(n_loops=1, n_sup_train=4, sample_n_sup="uniform"))
    train = [{"step": 1, "step_losses": [2.0], "grad_norm": 1.0}, {"step": 2, "step_losses": [2.0, 1.9, 1.8],
                                                                   "grad_norm": 1.0}]
    s = metrics.summarize({"train": train, "eval": [], "sample": []}, "t", 2, 1.0, 0, model, "abc")
    assert s["flops_per_token"] == (estimate_flops(model, n_sup=1) + estimate_flops(model, n_sup=3)) / 2
    assert s["flops_per_token"] < estimate_flops(model)  # 2 steps on average, of 4
