"""scripts/plot_run: the panels that show whether later supervision steps help, drawn from a run's metrics."""

import json
import os
import random
import sys

import pytest

from scripts import plot_run
from tests.support import processes
from tests.support.unwritable import FULL, READ_ONLY, dead_pid, fail_writes, one_line, temporaries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVAL_EVERY = 200, 25
GAPS = [0.0, -0.03, -0.04]  # what supervision steps 1 and 2 gain over the draft, under ~0.3 nats of batch noise
VAL = {0: [4.0, 4.0, 4.0]}  # the untrained model, far above the rest
VAL.update({s: [1.0 + 0.5 * 25 / s, 0.99 + 0.5 * 25 / s, 0.985 + 0.5 * 25 / s] for s in range(25, STEPS + 1, 25)})


@pytest.fixture
def run_dir(tmp_path):
    """A small run's metrics.jsonl (3 supervision steps), a base_loss result with 6 steps, and a torn last line."""
    rng = random.Random(0)
    lines = []
    for step in range(STEPS + 1):
        if step % EVAL_EVERY == 0:
            lines.append({"kind": "eval", "step": step, "val_bpb": VAL[step], "val_refinement": 0.0})
        if step:
            base = 2 + 3 * 0.98 ** step + rng.gauss(0, 0.3)  # batch noise, shared by the steps of one batch
            losses = [base + g + rng.gauss(0, 0.01) for g in GAPS]
            lines.append({"kind": "train", "step": step, "loss": losses[-1], "step_losses": losses,
                          "refinement": 0.0, "grad_norm": 1.0, "dt": 0.5})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "tra')
    (tmp_path / "base_loss_step000200.json").write_text(json.dumps(
        {"model_tag": "x", "step": 200, "n_sup": 6, "split_tokens": 32768,
         "val_bpb": [1.07, 1.06, 1.055, 1.056, 1.06, 1.07]}))
    return tmp_path


def labels(ax):
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_the_figure_shows_training_and_validation_gaps_and_the_inference_curve(run_dir):
    fig = plot_run.figure(str(run_dir))
    loss, gaps, val, val_gaps, inference = fig.axes
    for ax in (loss, gaps, val, val_gaps):  # over training: optimizer steps; the lines: supervision steps
        assert ax.get_xlabel() == "optimizer step"
        assert ax.get_legend().get_title().get_text() == "supervision step"
    assert labels(loss) == ["step 1 (draft)", "step 2", "step 3 (final)"]

    assert labels(gaps) == ["step 1 (the draft)", "step 2 - step 1", "step 3 (final) - step 1"]
    smoothed = {line.get_label(): line.get_ydata() for line in gaps.get_lines()}
    for s, label in ((1, "step 2 - step 1"), (2, "step 3 (final) - step 1")):
        assert len(smoothed[label]) == STEPS
        assert abs(smoothed[label][-1] - GAPS[s]) < 0.01  # the 0.03-nat gap, out of 0.3 nats of noise
    low, high = gaps.get_ylim()
    assert -0.1 < low < -0.04 and 0 < high < 0.05  # scaled to the gaps, not to the raw noise

    assert labels(val) == ["step 1 (draft)", "step 2", "step 3 (final)"]
    assert [list(line.get_xdata()) for line in val.get_lines()][0] == list(range(25, STEPS + 1, 25))
    low, high = val.get_ylim()
    assert high < 1.5 and low < VAL[STEPS][2]  # the untrained 4.0 and the steep start are off the scale
    assert "untrained (optimizer step 0): 4.00 = 4.00 = 4.00" in val.get_title()

    gap_lines = {line.get_label(): list(line.get_ydata()) for line in val_gaps.get_lines()}
    assert gap_lines["step 3 (final) - step 1"] == pytest.approx([-0.015] * 8)

    curves = {line.get_label(): list(line.get_ydata()) for line in inference.get_lines()}
    assert curves["during training, optimizer step 200: --eval_tokens of validation"] == VAL[STEPS]  # no meta.json
    assert curves["base_loss after training, checkpoint of step 200: the first 32,768 validation tokens"][3] == 1.056
    assert list(inference.get_xticks()) == [1, 2, 3, 4, 5, 6]
    assert inference.get_xlabel() == "supervision steps run (1 = the draft alone)"
    assert "trained with 3 supervision steps" in curves


@pytest.mark.parametrize("chat", [False, True], ids=["pretraining", "chat_sft"])
def test_the_inference_panel_says_how_much_text_each_curve_read(run_dir, chat):
    """The issue's two curves 0.1 bpb apart for one checkpoint: the labels give each one's sample in tokens (from the
    run's --eval_tokens as evaluated, whole rows of --max_seq_len, and base_loss's recorded count) and the title what a
    gap between them means."""
    meta = {"step": 200, "train_config": {"eval_tokens": 16500, "max_seq_len": 256}}  # 64 whole rows: 16,384
    if chat:
        meta["init_from"] = {"model_tag": "base", "step": 120}
    (run_dir / "step_000200").mkdir()
    (run_dir / "step_000200" / "meta.json").write_text(json.dumps(meta))
    inference = plot_run.figure(str(run_dir)).axes[4]
    during, after = labels(inference)[:2]
    assert after == "base_loss after training, checkpoint of step 200: the first 32,768 validation tokens"
    if chat:
        assert during == "during training, optimizer step 200: up to 16,384 tokens of held-out conversations"
        assert inference.get_title().endswith("solid: held-out conversations; dashed: the corpus's validation text")
    else:
        assert during == "during training, optimizer step 200: the first 16,384 validation tokens"
        assert inference.get_title().endswith("a gap between solid and dashed is the sample: more validation tokens, "
                                              "a surer number")


def test_the_command_writes_the_png_despite_a_torn_line(run_dir):
    # the one process of plot_run in the suite (elsewhere main is called in process): `python -m` reaches main
    proc = processes.run([sys.executable, "-m", "scripts.plot_run", str(run_dir)], timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and proc.stdout == f"plot: {run_dir / 'training.png'}\n", proc.stderr
    assert (run_dir / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "is cut off" in proc.stderr


def test_a_plain_model_without_evaluations_still_plots(tmp_path):
    records = [{"kind": "train", "step": s, "step_losses": [3.0 / s], "grad_norm": 1.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fig = plot_run.figure(str(tmp_path))
    assert labels(fig.axes[1]) == ["step 1 (the draft)"]  # no later step to compare
    assert "more steps: python -m scripts.base_loss" in fig.axes[4].texts[0].get_text()


def test_no_metrics_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit, match="plot_run: no metrics.jsonl in"):
        plot_run.main([str(tmp_path)])


@pytest.mark.parametrize("code", [FULL, READ_ONLY], ids=["full", "read-only"])
def test_a_plot_that_cannot_be_written_is_one_line_exit_5_and_the_next_plot_cleans_up(run_dir, capsys, code):
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(metrics.read_text().rsplit("\n", 1)[0] + "\n")  # without the torn line and its warning
    (run_dir / "training.png").write_bytes(b"the previous plot")
    stale = run_dir / f"training.png.tmp{dead_pid()}"  # left by a plot_run that was killed
    stale.write_bytes(b"")
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as stop:
        fail_writes(mp, run_dir, code, "training.png")
        plot_run.main([str(run_dir)])
    err = capsys.readouterr().err
    assert stop.value.code == 5 and one_line(err)
    assert err.startswith(f"plot_run: cannot write {run_dir}/training.png: ")
    assert err.endswith(", or pick another --out\n")
    assert (run_dir / "training.png").read_bytes() == b"the previous plot"
    assert temporaries(str(run_dir)) == []  # this plot's own temporary file and the killed one's
    plot_run.main([str(run_dir)])
    assert (run_dir / "training.png").read_bytes()[:4] == b"\x89PNG"
