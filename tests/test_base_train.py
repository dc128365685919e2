"""base_train end to end on a tiny model: resume exactness, crash safety, DDP equivalence, rejections, health stops;
and the batch geometry its parser derives."""

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from nanochat import trainer
from nanochat.cli import ExitCode
from nanochat.data import dataloader
from nanochat.data.tokenizer import get_tokenizer
from nanochat.train import config as train_config
from nanochat.train import planning
from nanochat.train.flops import estimate_flops
from tests.support import forked, processes
from tests.support.helpers import (
    ROOT,
    TINY,
    TINY_SHAPE,
    ckpt_dir,
    exit_code,
    parsed,
    random_model,
    tiny_config,
    tree,
    weights,
)


def run(base_dir, *flags, torchrun=False, check=True, script="scripts.base_train"):
    """A finished run's CompletedProcess. One base_train or base_loss process runs in this process (a start costs
    seconds here); torchrun=True runs 2 ranks as torchrun starts them and other scripts run as processes of their
    own, all forked from the torch-preloaded server (the claims are two ranks and a process, not torchrun's launch)."""
    if script in ("scripts.base_train", "scripts.base_loss") and not torchrun:
        proc = in_process(base_dir, flags, script)
    else:
        env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
        cmd = [sys.executable, "-m", script, *flags]
        proc = forked.run(cmd, timeout=300, cwd=ROOT, env=env) if not torchrun else \
            processes.finish(forked.Ranks(cmd, cwd=ROOT, env=env), 300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def in_process(base_dir, flags, script="scripts.base_train"):
    """The script's main in this process, its output and exit status as a process's (a message exit: status 1)."""
    import importlib
    main = importlib.import_module(script).main
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        try:
            main(list(flags))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                err.write(e.code + "\n")
    return subprocess.CompletedProcess(["base_train", *flags], code, out.getvalue(), err.getvalue())


def plot(base_dir, tag):
    """plot_run's exit code for a run, in this process."""
    from scripts import plot_run
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        return exit_code(plot_run.main, tag)


def meta(base_dir, tag, step):
    with open(os.path.join(ckpt_dir(base_dir, tag, step), "meta.json")) as f:
        return json.load(f)


def test_sigkill_then_resume_is_bit_identical(base_dir):
    flags = TINY + ["--num_iterations=8", "--save_every=2"]
    run(base_dir, *flags, "--model_tag=straight")
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir, "OMP_NUM_THREADS": "1"}
    proc = forked.Popen([sys.executable, "-m", "scripts.base_train", *flags, "--model_tag=killed"], cwd=ROOT,
                        env=env, stderr=subprocess.STDOUT)
    processes.read_until(proc, "step 00005/", timeout=300)  # kill between checkpoints: after step 5, before 6 saves
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(ckpt_dir(base_dir, "killed", 8))
    resumed = run(base_dir, *flags, "--model_tag=killed", "--resume")
    assert "resumed killed from step" in resumed.stdout
    a, b = weights(base_dir, "straight", 8), weights(base_dir, "killed", 8)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert meta(base_dir, "straight", 8)["dataloader"] == meta(base_dir, "killed", 8)["dataloader"]


def test_kill_during_checkpoint_write_leaves_previous_loadable(base_dir, tmp_path):
    run(base_dir, *TINY, "--num_iterations=2", "--save_every=2", "--model_tag=midsave")
    # a process that dies (SIGKILL) halfway through writing the step-4 checkpoint
    script = """
import os, signal, torch
from nanochat.checkpoint import manager as ckpt
model, _, meta = ckpt.load_model("midsave", "latest")
real_save = torch.save
def dying_save(obj, f, *a, **k):
    real_save(obj, f, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
from nanochat.checkpoint.writer import save_checkpoint
save_checkpoint("midsave", 4, model, [], {**meta}, {"loaders": []})
"""
    env = {**os.environ, "NANOCHAT_BASE_DIR": base_dir}
    proc = forked.run([sys.executable, "-c", script], timeout=120, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.path.isdir(ckpt_dir(base_dir, "midsave", 4) + ".tmp")  # the half-written attempt
    from nanochat.checkpoint import manager as ckpt
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    try:
        assert ckpt.list_steps("midsave") == [2]
        model, _, m = ckpt.load_model("midsave", "latest")
        assert m["step"] == 2
    finally:
        del os.environ["NANOCHAT_BASE_DIR"]
    resumed = run(base_dir, *TINY, "--num_iterations=4", "--save_every=2", "--model_tag=midsave", "--resume")
    assert "resumed midsave from step 2" in resumed.stdout
    assert not os.path.exists(ckpt_dir(base_dir, "midsave", 4) + ".tmp")


def test_two_gloo_processes_match_one_process_with_double_accumulation(base_dir):
    # 5 validation rows of 2 per batch: on 2 processes rank 0 evaluates batches 0 and 2, rank 1 batch 1 and padding
    flags = TINY + ["--num_iterations=4", "--grad_clip=0.5", "--eval_tokens=160", "--sample_every=2"]
    out = run(base_dir, *flags, "--gradient_accumulation_steps=1", "--model_tag=ddp2", torchrun=True,
              script="tests.support.sample_worker").stdout
    run(base_dir, *flags, "--gradient_accumulation_steps=2", "--model_tag=single2")

    def logged(tag, kind, key):
        with open(os.path.join(ckpt_dir(base_dir, tag), "metrics.jsonl")) as f:
            return [(r["step"], r[key]) for r in map(json.loads, f) if r["kind"] == kind]

    def records(tag, kind, key):
        return torch.tensor([value for _, value in logged(tag, kind, key)], dtype=torch.float64)

    # samples at steps 0, 2 and 4: each rank generates its half of the prompts and rank 0 logs them as one process
    # two ranks write to one pipe: a line may land inside another's, so find the announcements, not lines
    announced = sorted(re.findall(r"rank \d samples prompts \[[\d, ]*\]", out))
    assert announced == ["rank 0 samples prompts [0, 2]"] * 3 + ["rank 1 samples prompts [1, 3]"] * 3, out[-3000:]
    assert [step for step, _ in logged("ddp2", "sample", "samples")] == [0, 2, 4]
    assert logged("ddp2", "sample", "samples") == logged("single2", "sample", "samples")

    assert torch.allclose(records("ddp2", "train", "step_losses"), records("single2", "train", "step_losses"),
                          atol=1e-5)
    a, b = weights(base_dir, "ddp2", 4), weights(base_dir, "single2", 4)
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    # the training-time evaluation reads the same rows on 1 and 2 processes: at step 0 (the same weights) the same
    # bpb to float tolerance, at step 4 as close as the weights
    ddp_bpb, single_bpb = records("ddp2", "eval", "val_bpb"), records("single2", "eval", "val_bpb")
    assert torch.allclose(ddp_bpb[0], single_bpb[0], rtol=1e-9, atol=0)
    assert torch.allclose(ddp_bpb[1], single_bpb[1], atol=1e-5)
    # base_loss of one checkpoint: the same numbers on 1 and 2 processes (3 rows of train and of val)
    results = []
    for torchrun in (False, True):
        run(base_dir, "--model_tag=single2", "--split_tokens=100", "--device_batch_size=2", "--device_type=cpu",
            "--sample_tokens=1", torchrun=torchrun, script="scripts.base_loss")
        with open(os.path.join(ckpt_dir(base_dir, "single2"), "base_loss_step000004.json")) as f:
            results.append(json.load(f))
    for key in ("train_bpb", "val_bpb", "train_state", "val_state"):
        assert torch.allclose(torch.tensor(results[0][key]), torch.tensor(results[1][key]), rtol=1e-9, atol=0), key


def test_resume_with_a_different_config_names_the_fields(base_dir):
    run(base_dir, *TINY, "--num_iterations=2", "--model_tag=mismatch")
    before = tree(base_dir)
    proc = run(base_dir, *TINY, "--num_iterations=4", "--n_loops=2", "--n_sup_train=3", "--model_tag=mismatch",
               "--resume", check=False)
    assert proc.returncode != 0
    assert "n_loops: checkpoint 1 vs this run 2" in proc.stderr
    assert "n_sup_train: checkpoint 2 vs this run 3" in proc.stderr
    assert tree(base_dir) == before


def test_nan_loss_stops_with_diagnostic_and_keeps_last_good_checkpoint(base_dir, monkeypatch):
    import nanochat.model.gpt
    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    real_loss, calls = nanochat.model.gpt.deep_supervision_loss, []

    def poisoned(*args):  # the 4th training step's loss becomes NaN
        calls.append(1)
        total = real_loss(*args)
        return total * float("nan") if len(calls) == 4 else total

    monkeypatch.setattr(nanochat.model.gpt, "deep_supervision_loss", poisoned)
    with pytest.raises(SystemExit) as exit_info:
        base_train.main(TINY + ["--num_iterations=8", "--save_every=2", "--model_tag=nan"])
    assert exit_info.value.code == 3
    assert os.listdir(ckpt_dir(base_dir, "nan")).count("step_000002") == 1
    assert not os.path.exists(ckpt_dir(base_dir, "nan", 4))
    with open(os.path.join(ckpt_dir(base_dir, "nan"), "nan_diagnostic_step000003.json")) as f:
        diagnostic = json.load(f)
    assert diagnostic["step"] == 3 and len(diagnostic["last_good"]) == 3
    assert weights(base_dir, "nan", 2)  # still loadable


def test_max_hours_stops_cleanly_with_a_checkpoint(base_dir):
    proc = run(base_dir, *TINY, "--num_iterations=1000", "--max_hours=0.0000001", "--model_tag=budget")
    stop = [line for line in proc.stdout.splitlines() if line.startswith("budget spent (--max_hours=1e-07) at step")]
    assert len(stop) == 1
    stopped_at = int(stop[0].split("at step ")[1].split(":")[0])
    assert stopped_at <= 2  # far short of the 1000 iterations asked for
    steps = sorted(os.listdir(ckpt_dir(base_dir, "budget")))
    assert [s for s in steps if s.startswith("step_")] == [f"step_{stopped_at:06d}"]


def test_precedence_metrics_report_and_plot(base_dir):
    out = run(base_dir, *TINY, "--num_iterations=4", "--preset=extreme", "--improvement_reward_scale=0.7",
              "--model_tag=prec").stdout
    m = meta(base_dir, "prec", 4)
    assert m["model_config"]["supervision_weight_base"] == 10.0  # preset
    assert m["model_config"]["improvement_reward_scale"] == 0.7  # explicit flag beats the preset
    assert m["config_sources"]["improvement_reward_scale"] == "flag"
    assert m["config_sources"]["supervision_weight_base"] == "preset extreme"
    assert m["config_sources"]["activation_fn"] == "gpt.py default"
    assert len(m["val_bpb"]) == 2  # the final eval is recorded in the final checkpoint
    with open(os.path.join(ckpt_dir(base_dir, "prec"), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(len(r["step_losses"]) == 2 for r in train)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 4]
    # the recursion's state diagnostics, per supervision step, in every train and eval record and in the log
    for r in train + [r for r in records if r["kind"] == "eval"]:
        assert len(r["state"]) == 2 and all(len(row) == 4 for row in r["state"])
        rms_y, rms_z, rms_update, cos = r["state"][-1]
        assert rms_y > 0 and -1 <= cos <= 1
    # untrained, the zero-initialised projections make every block the identity: the state does not move; trained, it
    # does
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals[0]["state"][-1][2] < 1e-5 and evals[-1]["state"][-1][2] > 1e-3 and train[-1]["state"][-1][2] > 1e-3
    assert out.count("recursion state per step: rms y ") == 2
    assert out.count("CPU threads: ") == 1  # the run's choice, said once
    assert os.path.exists(os.path.join(ckpt_dir(base_dir, "prec"), "report.md"))
    png = os.path.join(ckpt_dir(base_dir, "prec"), "training.png")
    assert plot(base_dir, "prec") == 0
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_ema_publishes_the_average_trains_on_the_raw_weights_and_resumes_exactly(base_dir):
    from safetensors.torch import load_file
    flags = TINY + ["--num_iterations=4", "--save_every=2", "--ema_decay=0.5"]
    run(base_dir, *flags, "--model_tag=ema_straight")
    run(base_dir, *flags[:-2], "--num_iterations=2", "--save_every=2", "--ema_decay=0.5", "--model_tag=ema_split")
    run(base_dir, *flags, "--model_tag=ema_split", "--resume")
    for tag in ("ema_straight", "ema_split"):
        assert sorted(os.listdir(ckpt_dir(base_dir, tag, 4)))[-2:] == ["rank_0.pt", "train_weights.safetensors"]
    published, raw = weights(base_dir, "ema_straight", 4), load_file(
        os.path.join(ckpt_dir(base_dir, "ema_straight", 4), "train_weights.safetensors"))
    published_2 = weights(base_dir, "ema_straight", 2)
    # the average of decay 0.5 over steps 3 and 4, continued from step 2's: ema_4 = 0.5 ema_3 + 0.5 w_4, ...
    name = "transformer.h.0.mlp.c_fc.weight"
    assert not torch.equal(published[name], raw[name])
    assert (published[name] - raw[name]).abs().max() < (published_2[name] - raw[name]).abs().max()
    for a, b in ((published, weights(base_dir, "ema_split", 4)),
                 (raw, load_file(os.path.join(ckpt_dir(base_dir, "ema_split", 4), "train_weights.safetensors")))):
        assert all(torch.equal(a[k], b[k]) for k in a)  # resume continues the average and the raw weights exactly


@pytest.mark.parametrize("ema", ["--ema_decay=0", "--ema_decay=0.9"])
def test_a_training_step_reads_the_device_once(base_dir, monkeypatch, ema):
    # every way a tensor's value reaches Python is a host sync on a GPU; count them over 2 and 5 steps: the extra
    # 3 steps (no evaluation, sample or save in between) must cost exactly 3 reads, with the weight average too
    from tests.support.helpers import host_syncs
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    counts = []
    for n, tag in ((2, "syncs_a"), (5, "syncs_b")):
        run_config = train_config.parse_args([*TINY, f"--num_iterations={n}", "--eval_every=0", ema,
                                        f"--model_tag={tag}{ema[-1]}"])
        with host_syncs() as reads:
            trainer.train(run_config)
        counts.append(len(reads))
    assert counts[1] - counts[0] == 3, counts


def test_the_state_is_measured_every_k_steps_and_the_log_keeps_the_last_measured(base_dir, monkeypatch):
    # --diagnostics_every=3 over 6 steps: measured at steps 0, 3 and 5 (the first, every 3rd, the last), each train
    # record holding the last measured values and the step they are from
    from nanochat.model import gpt
    measured, real = [], gpt.state_diagnostics
    monkeypatch.setattr(gpt, "state_diagnostics", lambda *a: measured.append(1) or real(*a))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    trainer.train(train_config.parse_args([*TINY, "--num_iterations=6", "--eval_every=0", "--diagnostics_every=3",
                                           "--model_tag=every3"]))
    with open(os.path.join(ckpt_dir(base_dir, "every3"), "metrics.jsonl")) as f:
        train = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["state_step"] for r in train] == [1, 1, 1, 4, 4, 6]
    assert train[1]["state"] == train[0]["state"] and train[3]["state"] != train[2]["state"]
    assert all(len(r["state"]) == 2 and r["state"][-1][0] > 0 for r in train)
    assert len(measured) == 3 * 2 + 2  # 3 steps x 2 supervision steps, one micro-batch each; the final evaluation's


@pytest.mark.parametrize("flags, scope", [(["--n_loops=0", "--n_sup_train=1"], "model"), ([], "layer")])
def test_compile_compiles_the_ema_copy_too_in_the_settled_scope(base_dir, monkeypatch, flags, scope):
    # the EMA is deep-copied from the model before compilation: without its own compiled regions, evaluation with the
    # EMA (automatic from 300 steps) ran eager; a stand-in compile_regions records who asks for what
    compiled = []
    monkeypatch.setattr(trainer, "compile_regions", lambda model, scope="layer", backend="inductor":
                        compiled.append((model, scope)))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    run_config = train_config.parse_args([*TINY, *flags, "--num_iterations=2", "--eval_every=0", "--compile",
                                          "--ema_decay=0.5", f"--model_tag=ema_compiled_{scope}"])
    assert run_config.compile_scope == scope
    built = []
    real_ema = trainer.build_weight_average
    monkeypatch.setattr(trainer, "build_weight_average", lambda *a: built.append(real_ema(*a)) or built[-1])
    trainer.train(run_config)
    assert [(model is built[0].module, s) for model, s in compiled] == [(False, scope), (True, scope)]


def test_mfu_counts_the_steps_drawn_a_1_step_and_a_7_step_draw_read_the_same(base_dir, monkeypatch):
    # --peak_tflops' help says MFU uses it (base_train read only the GPU table, so a CPU showed none); and under drawn
    # step counts MFU counted n_sup_train steps whatever was drawn: an H200 printed "mfu 92.7%" for a 1-step batch
    # and "13.4%" for a 7-step one. A fake clock runs every supervision step in the same time (the same kernels):
    # then every step's MFU must read the same, while tok/s (the batch's tokens per second) follows the draw.
    from nanochat.model.gpt import GPT
    clock, real = [1000.0], GPT.forward_backward

    def forward_backward(self, *args, n_sup=None, **kwargs):
        clock[0] += 0.25 * n_sup
        return real(self, *args, n_sup=n_sup, **kwargs)

    monkeypatch.setattr(GPT, "forward_backward", forward_backward)
    monkeypatch.setattr(trainer, "time", SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    # uniform draws on 1 .. 7 around n_sup_train=4, no curriculum: step 1 draws 1, step 14 draws 7
    trainer.train(train_config.parse_args([*TINY, "--n_sup_train=4", "--sample_n_sup=uniform", "--n_sup_warmup=0",
                                           "--backprop_steps=1", "--num_iterations=15",
                                           "--eval_every=0", "--peak_tflops=0.002", "--model_tag=mfu"]))
    with open(os.path.join(ckpt_dir(base_dir, "mfu"), "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if r["kind"] == "train"]
    by_depth = {len(r["step_losses"]): r for r in steps}
    assert {1, 7} <= set(by_depth) and len(steps) == 15
    one, seven = by_depth[1], by_depth[7]
    assert one["dt"] == pytest.approx(0.25) and seven["dt"] == pytest.approx(7 * 0.25)
    assert one["tok_per_sec"] == pytest.approx(7 * seven["tok_per_sec"])  # the same tokens, 7x the compute
    assert one["mfu"] == pytest.approx(seven["mfu"], rel=1e-9) and 0 < one["mfu"]
    assert all(r["mfu"] == pytest.approx(one["mfu"], rel=1e-9) for r in steps)
    # against the peak: one supervision step's FLOPs per token (a 1-step draw's) x tokens / (0.25 s x 2 GFLOP/s)
    model = trainer.build_model({**train_config.parse_args([*TINY, "--n_sup_train=4"]).model_config,
                                 "vocab_size": get_tokenizer().get_vocab_size()}, torch.device("cpu"), False, "float32")
    tokens = one["tok_per_sec"] * one["dt"]
    assert one["mfu"] == pytest.approx(estimate_flops(model, n_sup=1) * tokens / (0.25 * 0.002e12))


def test_sampled_depth_trains_logs_and_plots(base_dir):
    # each optimizer step trains 1 .. 3 supervision steps: the log, the metrics, the summary and the plot follow
    out = run(base_dir, *TINY, "--num_iterations=6", "--sample_n_sup", "--model_tag=sampled").stdout
    with open(os.path.join(ckpt_dir(base_dir, "sampled"), "metrics.jsonl")) as f:
        depths = [len(r["step_losses"]) for r in map(json.loads, f) if r["kind"] == "train"]
    from nanochat.model.gpt import GPTConfig
    from nanochat.train.depth import train_depth
    config = GPTConfig(vocab_size=1, n_layer=1, n_embd=32, n_head=2, n_kv_head=2, sequence_len=32, n_sup_train=2,
                       sample_n_sup=True)
    assert depths == [train_depth(config, step) for step in range(6)] and len(set(depths)) > 1
    assert out.count("step 0000") == 6
    assert plot(base_dir, "sampled") == 0


def test_the_step_count_warmup_trains_one_step_first_and_all_of_them_by_its_fraction(base_dir):
    # --n_sup_warmup=0.5 over 8 steps at n_sup_train=4: the cap 1 + int(4 * step / 4) rises 1, 2, 3, 4, then holds
    from nanochat.model.gpt import GPTConfig
    from nanochat.train.depth import train_depth

    def depths(tag):
        with open(os.path.join(ckpt_dir(base_dir, tag), "metrics.jsonl")) as f:
            return [len(r["step_losses"]) for r in map(json.loads, f) if r["kind"] == "train"]

    warm = ["--num_iterations=8", "--n_sup_train=4", "--n_sup_warmup=0.5"]
    run(base_dir, *TINY, *warm, "--model_tag=warm")  # TINY: a fixed depth
    assert depths("warm") == [1, 2, 3, 4, 4, 4, 4, 4]
    # with the log-normal draw it caps the draw: never above the ramp, the draw itself past it
    run(base_dir, *TINY, *warm, "--sample_n_sup=lognormal_poisson", "--model_tag=warm_drawn")
    drawn = GPTConfig(sequence_len=8, vocab_size=8, n_layer=1, n_head=2, n_kv_head=2, n_embd=32, n_sup_train=4,
                      sample_n_sup="lognormal_poisson")
    assert depths("warm_drawn") == [min(train_depth(drawn, s), 1 + s) for s in range(8)]


def test_the_out_of_memory_advice_keeps_the_effective_batch_and_suggests_only_what_is_off():
    run_config = train_config.parse_args([*TINY, "--device_batch_size=8", "--gradient_accumulation_steps=2"])
    message = trainer.oom_message(run_config)
    assert "--device_batch_size (e.g. 4) with --gradient_accumulation_steps=4" in message
    assert "--detach_between_steps" not in message  # on by default
    off = trainer.oom_message(train_config.parse_args([*TINY, "--detach_between_steps=false"]))
    assert "--detach_between_steps" in off


def test_out_of_memory_in_a_step_exits_with_the_advice_and_code(base_dir, monkeypatch, capsys):
    import nanochat.model.gpt
    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(nanochat.model.gpt.GPT, "forward_backward", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        base_train.main(TINY + ["--num_iterations=2", "--model_tag=oom"])
    assert exit_info.value.code == ExitCode.OUT_OF_MEMORY
    assert "CUDA out of memory at --device_batch_size=" in capsys.readouterr().err


def test_the_weight_average_is_on_for_long_runs_only():
    """auto, the default, averages runs of 300+ steps only (shorter runs lost to it, see dev/LOG.md); 0
    turns it off; the launcher's memory plan counts its weight copy exactly when it is on."""
    auto, off = (train_config.parse_args([*TINY, *flags]).ema_decay for flags in ([], ["--ema_decay=0"]))
    assert planning.ema_decay_for(auto, 1000) == pytest.approx(0.99) and planning.keeps_ema(auto, 1000)
    assert planning.ema_decay_for(auto, 120) == 0 and not planning.keeps_ema(auto, 120)
    assert planning.ema_decay_for(off, 1000) == 0 and not planning.keeps_ema(off, 1000)
    assert planning.ema_decay_for(train_config.parse_args([*TINY, "--ema_decay=0.9"]).ema_decay, 120) == 0.9
    # no step count before the run (--target_flops): count the copy unless it is off
    assert planning.keeps_ema(auto, None) and not planning.keeps_ema(off, None)


def test_samples_during_training_run_in_the_training_dtype(base_dir, monkeypatch):
    # bf16 on a GPU; CPU autocast stands in for it: every cached (sampling) forward must run under it
    from nanochat.model.gpt import GPT
    seen, real = [], GPT.forward

    def forward(self, *args, kv_cache=None, **kwargs):
        if kv_cache is not None:
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return real(self, *args, kv_cache=kv_cache, **kwargs)

    monkeypatch.setattr(GPT, "forward", forward)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    trainer.train(train_config.parse_args([*TINY, "--num_iterations=1", "--dtype=bfloat16", "--model_tag=bf16"]))
    assert seen and all(seen_dtype == (True, torch.bfloat16) for seen_dtype in seen)


def test_each_rank_samples_its_share_and_rank_0_reports_them_as_one_process(base_dir, monkeypatch, capsys):
    # rank 0 of 2: its share (prompts 0 and 2) generated here, rank 1's handed to it by the gather
    from types import SimpleNamespace

    from nanochat.data.tokenizer import get_tokenizer
    from nanochat.model.engine import Engine
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    tokenizer = get_tokenizer()
    model = random_model(tiny_config(vocab_size=tokenizer.get_vocab_size()), every_weight=True)
    run_config, never = train_config.parse_args(TINY), lambda: False
    rows, generate = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, **kwargs: rows.append(len(prompts)) or
                        generate(self, prompts, **kwargs))

    def samples(share, theirs=None, stop=never):
        """What rank share[0] prints and logs, and what it hands to the gather."""
        logged, sent = [], []
        monkeypatch.setattr(trainer, "gather_shares", lambda mine, count: sent.append(mine) or [mine, theirs])
        trainer.run_samples(model, tokenizer, run_config, SimpleNamespace(log=logged.append), 7, stop, share)
        return capsys.readouterr().out, logged, sent

    alone, alone_logged, sent = samples((0, 1))
    assert rows == [4] and sent == [] and alone.count("sample: ") == 4, alone
    completions = [completion for _, completion in alone_logged[0]["samples"]]
    assert len(set(completions)) == 4  # distinct: a completion in the wrong place shows
    theirs = trainer.sample_share(model, tokenizer, run_config, trainer.SAMPLE_PROMPTS[1::2], never)
    assert samples((0, 2), theirs) == (alone, alone_logged, [(completions[0::2], None)])
    assert rows == [4, 2, 2]  # rank 1's share, then rank 0's: half the prompts each
    assert trainer.sample_share(model, tokenizer, run_config, [], never) == ([], None) and len(rows) == 3
    # a share cut short by a signal, or failed, on either rank: every rank still gathers, and nothing is logged
    abandoned = "samples abandoned: a stop signal arrived\n"
    assert samples((0, 2), (None, trainer.STOPPED)) == (abandoned, [], [(completions[0::2], None)])
    assert samples((0, 2), theirs, stop=lambda: True) == (abandoned, [], [(None, trainer.STOPPED)])
    skipped = "WARNING: sampling failed and was skipped: "
    assert samples((0, 2), (None, "ValueError: injected"))[:2] == (skipped + "on rank 1: ValueError: injected\n", [])

    def fail(self, prompts, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(Engine, "generate", fail)
    assert samples((0, 2), theirs) == (skipped + "on rank 0: RuntimeError: injected\n", [],
                                       [(None, "RuntimeError: injected")])
    assert samples((0, 1)) == (skipped + "RuntimeError: injected\n", [], [])  # one process: today's line
    assert model.training  # back to training after a failed share too


# ------------------------------------------------ the batch geometry and WANDB_RUN, as base_train parses them


def test_the_default_total_batch_is_fixed_and_the_accumulation_follows_the_processes():
    """The compute-optimal batch depends on the model and its horizon, not on the processes (1 or 8 GPUs train the
    same model); its value is tests/test_train_config.py's."""
    one, two = parsed(TINY_SHAPE, world_size=1), parsed(TINY_SHAPE, world_size=2)
    assert one["total_batch_size"] == two["total_batch_size"]
    assert one["grad_accum"] == 2 * two["grad_accum"] == one["total_batch_size"] // (2 * 32)


def test_one_and_two_processes_read_the_same_data_ranks_in_each_step():
    """The loaders of process r read data ranks data_ranks(r, grad_accum) of world_size x grad_accum; with a fixed total
    batch, 1 and 2 processes split the stream into the same ranks and read all of them every step. (That equal data
    ranks give equal training is the two-process Gloo test above.)"""
    # 2 accumulation steps on 1 process, 1 on 2
    geometry = ["--max_seq_len=32", "--device_batch_size=8192", "--total_batch_size=524288"]
    reads = {}
    for world in (1, 2):
        run_config = train_config.parse_args(TINY_SHAPE + geometry, world_size=world, check_hardware=False)
        reads[world] = ([dataloader.data_ranks(rank, run_config.grad_accum) for rank in range(world)],
                        world * run_config.grad_accum)
    assert reads[1] == ([[0, 1]], 2)
    assert reads[2] == ([[0], [1]], 2)


@pytest.mark.parametrize("world, flags, message", [
    (3, ["--total_batch_size=524288"], "--total_batch_size=524288 is not a multiple of processes x device_batch_size x "
                                       "max_seq_len = 3 x 2 x 32 = 192; pass --total_batch_size=524352"),
    # more than the whole batch in one step
    (1, ["--device_batch_size=16385", "--total_batch_size=524288"], "pass --total_batch_size=524320"),
    (1, ["--total_batch_size=100"], "--total_batch_size=100 is not a multiple"),
    (1, ["--total_batch_size=128", "--gradient_accumulation_steps=4"], "give only one of them"),
])
def test_a_batch_that_does_not_divide_names_the_flag_to_pass(world, flags, message):
    with pytest.raises(SystemExit) as e:
        train_config.parse_args(TINY_SHAPE + flags, world_size=world, check_hardware=False)
    assert message in str(e.value.code)


def test_explicit_accumulation_sets_the_batch():
    args = parsed(TINY_SHAPE + ["--gradient_accumulation_steps=3"], world_size=2)
    assert (args["grad_accum"], args["total_batch_size"]) == (3, 2 * 2 * 32 * 3)


def test_wandb_run_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("WANDB_RUN", "from_env")
    assert parsed(TINY_SHAPE)["wandb_run"] == "from_env"
    assert parsed(TINY_SHAPE + ["--run=from_flag"])["wandb_run"] == "from_flag"
    monkeypatch.delenv("WANDB_RUN")
    assert parsed(TINY_SHAPE)["wandb_run"] == "dummy"


# the learning rates at 0: the weights never move, so no evaluation after the first beats it
STILL = ["--matrix_lr=0", "--embedding_lr=0", "--unembedding_lr=0"]


def test_early_stop_after_k_evaluations_without_improvement(base_dir):
    # on 2 Gloo processes (the ranks stop together): test_launch's test_an_early_stop_is_a_success_for_the_launcher
    tag = "early0"
    flags = TINY + STILL + ["--num_iterations=20", "--eval_every=1", "--save_every=0", f"--model_tag={tag}"]
    out = run(base_dir, *flags, "--early_stop=2").stdout  # exit code 0: run() checks it
    stop = [line for line in out.splitlines() if line.startswith("early stop (--early_stop=2): ")]
    assert len(stop) == 1 and stop[0].endswith("(step 0) for 2 evaluations in a row at step 2: saving and stopping")
    assert [d for d in os.listdir(ckpt_dir(base_dir, tag)) if d.startswith("step_")] == ["step_000002"]
    assert meta(base_dir, tag, 2)["val_bpb"]  # saved after its evaluation, which it records
    with open(os.path.join(ckpt_dir(base_dir, tag), "summary.json")) as f:
        assert json.load(f)["step"] == 2
    # resumed with more patience: step 2's evaluation is not counted twice, step 3's is the third
    out = run(base_dir, *flags, "--early_stop=3", "--resume").stdout
    assert "(step 0) for 3 evaluations in a row at step 3: saving and stopping" in out, out[-2000:]


@pytest.mark.parametrize("torchrun", [False, pytest.param(True, marks=pytest.mark.slow)])  # torchrun: 20 s more
def test_a_shard_damaged_mid_run_saves_the_last_step_and_stops_with_one_line(base_dir, tmp_path, torchrun):
    own = tmp_path / "base"  # this run's own corpus, damaged below
    for name in ("base_data", "tokenizer"):
        shutil.copytree(os.path.join(base_dir, name), own / name)
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(own), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    flags = [*TINY, "--num_iterations=1000", "--eval_every=0", "--save_every=0", "--model_tag=damaged"]
    if torchrun:  # torchrun's own report of a failed worker is part of the claim: the real launcher
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "-m", "scripts.base_train", "--", *flags],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    else:
        proc = forked.Popen([sys.executable, "-m", "scripts.base_train", *flags], cwd=ROOT, env=env,
                            stderr=subprocess.STDOUT)
    processes.read_until(proc, "step 00002/", timeout=300)
    shard = own / "base_data" / "shard_00001.parquet"  # the second training shard: read some 30-60 steps later
    shard.write_bytes(shard.read_bytes()[:100])
    out = processes.finish(proc, timeout=300).stdout
    assert proc.returncode == (1 if torchrun else 6), out[-3000:]  # torchrun's own code when a worker failed
    lines = [line for line in out.splitlines() if line.startswith("base_train: reading the training data failed")]
    assert len(lines) == (2 if torchrun else 1), out[-3000:]  # every rank, in one line each
    assert "shard_00001.parquet: unreadable shard" in lines[0] and "download it again" in lines[0]  # no manifest
    stopped = int(lines[0].split("Stopped at step ")[1].split(",")[0])
    assert stopped > 2 and [d for d in os.listdir(own / "base_checkpoints" / "damaged") if d.startswith("step_")] == [
        f"step_{stopped:06d}"]
    # no worker's traceback; torchrun reports a failed worker with one of its own (ChildFailedError)
    assert out.count("Traceback") == (1 if torchrun else 0) and (not torchrun or "ChildFailedError" in out), out[-3000:]


# ------------------------------------------------ train()'s stages, each called alone


def test_the_checkpoint_meta_holds_what_a_resume_checks_and_continues():
    from types import SimpleNamespace

    from nanochat.checkpoint import resume
    from nanochat.train import lifecycle
    run_config = train_config.parse_args([*TINY, "--num_iterations=6", "--warmup_steps=2", "--early_stop=3"])
    model_config = {**run_config.model_config, "vocab_size": 300}
    corpus = {"fingerprint": "abc123", "dir": "/data", "shards": 3}
    early_stop = lifecycle.EarlyStop(3)
    early_stop.record(4, 1.25)
    meta = json.loads(json.dumps(trainer.checkpoint_meta(  # as meta.json holds it
        run_config, model_config, "tok", corpus, 6, 2, val_bpb=[1.5, 1.25], elapsed_seconds=12.5,
        early_stop=early_stop.state(), cost=0.25, loader_state={"position": 3})))
    # what start_or_resume checks: the model config, batch geometry and sharding; the tokenizer; the data
    assert resume.resume_differences(meta, model_config, train_config.batch_geometry(run_config),
                                     run_config.sharding) == []
    assert meta["tokenizer_fingerprint"] == "tok"
    resume.check_data(meta, corpus, False, "step 4")  # the same data: no refusal
    # what the resumed run continues: the clock, the schedule (report_schedule_change) and early stopping's count
    assert meta["elapsed_seconds"] == 12.5
    assert (meta["num_iterations"], meta["warmup_steps"], meta["train_config"]["warmdown_ratio"],
            meta["train_config"]["final_lr_frac"]) == (6, 2, run_config.warmdown_ratio, run_config.final_lr_frac)
    resumed = trainer.early_stop_for(run_config, SimpleNamespace(step=4, meta=meta))
    assert (resumed.best, resumed.stale, resumed.last_step) == ([4, 1.25], 0, 4)
    assert meta["val_bpb"] == [1.5, 1.25] and meta["dataloader"] == {"position": 3}


def test_the_evaluation_stage_records_its_bpb_and_step_and_a_stopped_one_keeps_the_last(tmp_path, monkeypatch):
    import dataclasses
    from types import SimpleNamespace

    from nanochat.checkpoint import manager as ckpt
    from nanochat.checkpoint.writer import CheckpointWriter
    from nanochat.eval.loss_eval import EvaluationStopped, refinement
    from nanochat.train import lifecycle
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    os.makedirs(ckpt.step_dir("alone", 4))
    with open(os.path.join(ckpt.step_dir("alone", 4), "meta.json"), "w") as f:
        json.dump({"step": 4, "val_bpb": None}, f)  # step 4's checkpoint, saved before its evaluation
    results = iter([([1.5, 1.25], "state"), None])

    def validation(*args, stop, batches):
        result = next(results)
        if result is None:
            raise EvaluationStopped()  # a signal arrived during the evaluation
        return result

    monkeypatch.setattr(trainer, "validation_bpb", validation)
    logged = []
    parts = {f.name: None for f in dataclasses.fields(trainer.Run)}  # only what evaluation uses is given
    run = trainer.Run(**{**parts, "run_config": train_config.parse_args([*TINY, "--model_tag=alone"]), "rank": 0,
                            "early_stop": lifecycle.EarlyStop(2), "writer": CheckpointWriter(background=False),
                            "metrics": SimpleNamespace(log=logged.append, attempt=lambda write: write())})
    assert run.evaluate(4) is True
    assert run.val_bpb == [1.5, 1.25] and run.last_eval_step == 4
    assert run.early_stop.best == (4, 1.25)
    assert logged == [{"kind": "eval", "step": 4, "val_bpb": [1.5, 1.25], "val_refinement": refinement([1.5, 1.25]),
                       "state": "state"}]
    with open(os.path.join(ckpt.step_dir("alone", 4), "meta.json")) as f:
        assert json.load(f)["val_bpb"] == [1.5, 1.25]
    assert run.evaluate(6) is False  # stopped: the last measurement stands, for the checkpoint of step 4 only
    assert run.val_bpb == [1.5, 1.25] and run.last_eval_step == 4 and len(logged) == 1
