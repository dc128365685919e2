"""What --resume checks before it writes anything: the process count the checkpoint was written by (1 and 2 Gloo
processes as torchrun starts them), the data it was trained on (its fingerprint), and the schedule it followed."""

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat.data import dataset
from scripts import base_train
from tests.conftest import make_corpus
from tests.support.helpers import TINY, ckpt_dir, exit_code, private_base_dir, tree
from tests.test_base_train import run

FLAGS = TINY + ["--eval_every=0", "--save_every=1", "--keep_last=0", "--num_iterations=2"]


def error_lines(proc):
    """base_train's own error lines (torchrun adds its report of the failed workers around them)."""
    return [line for line in proc.stderr.splitlines() if line.startswith("base_train:")]


@pytest.mark.parametrize("saved, resumed", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])  # one way in CI
def test_resuming_on_another_process_count_refuses_naming_both(base_dir, saved, resumed):
    tag = f"procs{saved}to{resumed}"
    run(base_dir, *FLAGS, f"--model_tag={tag}", torchrun=saved == 2)
    before = tree(base_dir)
    proc = run(base_dir, *FLAGS, "--num_iterations=4", f"--model_tag={tag}", "--resume", torchrun=resumed == 2,
               check=False)
    assert proc.returncode != 0
    lines = error_lines(proc)
    assert lines and len(set(lines)) == 1, proc.stderr[-3000:]  # every rank says the same one line
    processes = "1 process" if saved == 1 else "2 processes"
    assert f"checkpoint step 2 of '{tag}' was written by {processes} and this run has {resumed}" in lines[0]
    launch = "python -m scripts.base_train" if saved == 1 else "torchrun --nproc_per_node=2 -m scripts.base_train"
    assert launch in lines[0] and "--device_batch_size=2 --gradient_accumulation_steps=1" in lines[0]
    output = proc.stdout + proc.stderr
    assert "unreadable" not in output and "skipping" not in output  # the newest checkpoint is not called damaged
    if resumed == 1:
        assert proc.stderr.strip().splitlines() == lines
    assert tree(base_dir) == before


# ---------------------------------------------------------------------------------------------------- the data
@pytest.fixture
def base(base_dir, tmp_path, monkeypatch):
    """A private copy of the shards, which a test may replace."""
    return private_base_dir(base_dir, tmp_path, monkeypatch, copy_data=True)


def train(*flags):
    return exit_code(base_train.main, *flags)


def read_meta(base, tag, step):
    with open(os.path.join(ckpt_dir(base, tag, step), "meta.json")) as f:
        return json.load(f)


def replace_shard(path):
    """Another valid shard under the same name, with the same row groups: only its text (and so its size) differs."""
    shard = pq.ParquetFile(path)
    groups = [shard.read_row_group(g).column("text").to_pylist() for g in range(shard.num_row_groups)]
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for texts in groups:
            writer.write_table(pa.table({"text": [text + " and more" for text in texts]}))


def test_a_replaced_shard_is_refused_and_allow_data_change_goes_on(base, capsys):
    assert train(*FLAGS, "--model_tag=swap") == 0
    trained_on = read_meta(base, "swap", 2)["data"]
    assert trained_on["fingerprint"] == dataset.corpus_identity()["fingerprint"] and trained_on["shards"] == 3
    replace_shard(os.path.join(base, "base_data", "shard_00001.parquet"))
    now = dataset.corpus_identity()["fingerprint"]
    assert now != trained_on["fingerprint"]
    capsys.readouterr()
    before = tree(base)
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=swap", "--resume") == 1
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and "resumed" not in out
    assert f"trained on data {trained_on['fingerprint']}" in err and f"this run's data is {now}" in err
    assert "--allow_data_change" in err
    assert tree(base) == before
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=swap", "--resume", "--allow_data_change") == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING: --allow_data")]
    assert len(warnings) == 1 and trained_on["fingerprint"] in warnings[0] and now in warnings[0]
    assert read_meta(base, "swap", 4)["data"]["fingerprint"] == now  # the checkpoint records what it went on with


def test_another_data_dir_is_refused_and_a_copy_of_the_same_data_is_not(base, tmp_path, monkeypatch, capsys):
    assert train(*FLAGS, "--model_tag=moved") == 0
    trained_on = read_meta(base, "moved", 2)["data"]["fingerprint"]
    other = tmp_path / "other_corpus"
    make_corpus(str(other), num_shards=4)
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(other))
    capsys.readouterr()
    before = tree(base)
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=moved", "--resume") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and trained_on in err[0] and dataset.corpus_identity()["fingerprint"] in err[0]
    assert "3 shards in" in err[0] and f"4 shards in {other}" in err[0]
    assert tree(base) == before
    shutil.copytree(os.path.join(base, "base_data"), tmp_path / "same_corpus")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "same_corpus"))
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=moved", "--resume") == 0


def test_a_checkpoint_without_a_data_fingerprint_resumes_with_a_note(base, capsys):
    assert train(*FLAGS, "--model_tag=old") == 0
    path = os.path.join(ckpt_dir(base, "old", 2), "meta.json")
    meta = read_meta(base, "old", 2)
    del meta["data"]
    with open(path, "w") as f:
        json.dump(meta, f)
    capsys.readouterr()
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=old", "--resume") == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "records no data fingerprint" in line]
    assert len(notes) == 1 and notes[0].startswith("note: checkpoint old step 2")


def test_a_saved_position_missing_from_the_data_is_one_line_before_anything(base, tmp_path, monkeypatch, capsys):
    assert train(*FLAGS, "--model_tag=gone") == 0
    position = read_meta(base, "gone", 2)["dataloader"]
    later = tmp_path / "later_shards"  # shards 1-3 of a corpus: the saved shard 0 is not among them
    make_corpus(str(later), num_shards=4)
    os.remove(later / position["shard"])
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(later))
    capsys.readouterr()
    before = tree(base)
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=gone", "--resume", "--allow_data_change") == 1
    out, err = capsys.readouterr()
    assert "resumed" not in out and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert f"{position['shard']} row group {position['row_group']}" in err and "not in the current data" in err
    assert tree(base) == before


# ---------------------------------------------------------------------------------------------------- the schedule
def test_extending_a_finished_run_says_how_the_schedule_changes(base, capsys):
    assert train(*FLAGS, "--num_iterations=10", "--model_tag=longer") == 0
    capsys.readouterr()
    assert train(*FLAGS, "--num_iterations=20", "--model_tag=longer", "--resume") == 0
    out = capsys.readouterr().out.splitlines()
    changed = [line for line in out if line.startswith("resuming with another learning-rate schedule")]
    # by hand: the last 20% warm down linearly, so step 11 (index 10) had 0 of 10 steps left, and has 10 of 20 now
    assert changed == ["resuming with another learning-rate schedule: horizon 10 -> 20 steps (--num_iterations); the "
                       "lr multiplier of step 11: 0.00 -> 1.00 (--num_iterations=10 keeps the checkpoint's horizon)"]
    assert any(line.startswith("step 00011/20") and "lrm 1.00" in line for line in out)
    assert train(*FLAGS, "--num_iterations=20", "--model_tag=longer", "--resume") == 0  # the same schedule
    assert "learning-rate schedule" not in capsys.readouterr().out


def point(step, meta):
    from nanochat.checkpoint.resume import ResumePoint
    return ResumePoint(step, meta, weights=None, rank_state=None, train_weights=None)


def test_a_changed_warmdown_or_an_unrecorded_warmup_is_reported(capsys):
    from nanochat.checkpoint.resume import report_schedule_change
    saved = {"num_iterations": 100, "warmup_steps": 1, "train_config": {"warmdown_ratio": 0.2, "final_lr_frac": 0.0}}
    report_schedule_change(point(60, saved), (100, 1, 0.5, 0.0), "--num_iterations")
    # by hand: step index 60 is before a 20-step warmdown (1.0) and 10 steps into a 50-step one (40/50 = 0.8)
    assert capsys.readouterr().out == (
        "resuming with another learning-rate schedule: warmdown ratio 0.2 -> 0.5; the lr multiplier of step 61: "
        "1.00 -> 0.80\n")
    report_schedule_change(point(60, saved), (100, 1, 0.2, 0.0), "--num_iterations")
    assert capsys.readouterr().out == ""
    del saved["warmup_steps"]  # a checkpoint from before the record: its multiplier is not known
    report_schedule_change(point(60, saved), (200, 1, 0.2, 0.0), "--target_param_data_ratio=20")
    assert capsys.readouterr().out == (
        "resuming with another learning-rate schedule: horizon 100 -> 200 steps (--target_param_data_ratio=20); the "
        "lr multiplier of step 61: unrecorded -> 1.00 (--num_iterations=100 keeps the checkpoint's horizon)\n")
