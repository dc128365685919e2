"""Checkpoint policy, in process on a tiny model: safetensors and old model.pt, RNG restore for a non-CPU device, a
corrupt newest checkpoint, a full disk, a swapped tokenizer, a fresh run on a used tag, the disk preflight, backup,
and files crafted to run code when read (rank files, a sharded checkpoint's index and values)."""

import io
import json
import os
import pickle
import random
import shutil
import warnings
import zipfile

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanochat import trainer
from nanochat.checkpoint import manager as ckpt
from nanochat.checkpoint import resume
from nanochat.checkpoint import writer as checkpoint_writer
from nanochat.checkpoint.backup import Backup
from nanochat.checkpoint.manager import build_model
from nanochat.checkpoint.safe_load import RefusedObject, load_shards
from nanochat.train.optim import setup_optimizers
from scripts import base_train
from tests.support.helpers import TINY, ckpt_dir, exit_code, private_base_dir, tree, weights
from tests.support.unwritable import FullDiskFile

FLAGS = TINY + ["--eval_every=0", "--save_every=2"]


@pytest.fixture
def base(base_dir, tmp_path, monkeypatch):
    return private_base_dir(base_dir, tmp_path, monkeypatch)


def train(*flags):
    return exit_code(base_train.main, *flags)


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def test_weights_are_safetensors_and_old_model_pt_checkpoints_still_load(base):
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=st") == 0
    step = ckpt_dir(base, "st", 2)
    assert sorted(os.listdir(step)) == ["meta.json", "model.safetensors", "rank_0.pt"]
    expected = weights(base, "st", 2)
    # an old checkpoint: the same weights as model.pt, no safetensors file
    torch.save(expected, os.path.join(step, "model.pt"))
    os.remove(os.path.join(step, "model.safetensors"))
    model, _, meta = ckpt.load_model("st", "latest")
    assert meta["step"] == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.filterwarnings("ignore:.*meta parameter")
def test_rng_is_restored_when_the_run_is_on_a_non_cpu_device(base):
    """The GPU case: model and optimizers on a device other than the CPU (meta stands in for cuda)."""
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=rng") == 0
    saved = torch.load(os.path.join(ckpt_dir(base, "rng", 2), "rank_0.pt"), weights_only=True)["rng"]  # plain data
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    expected = (torch.rand(4), random.random())
    torch.manual_seed(123), random.seed(123)  # anything else
    point = resume.load_resume_point("rng", "latest", rank=0)
    model = build_model(point.meta["model_config"], torch.device("meta"))
    resume.restore(point, model, setup_optimizers(model))
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]


@pytest.mark.parametrize("damaged", ["model.safetensors", "rank_0.pt", "meta.json"])
def test_resume_skips_a_corrupt_newest_checkpoint(base, damaged, capsys):
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=bad") == 0
    truncate(os.path.join(ckpt_dir(base, "bad", 4), damaged))
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=bad", "--resume") == 0
    out = capsys.readouterr().out
    assert "WARNING: skipping checkpoint step 4 of bad: loading checkpoint step 4 failed" in out
    assert f"step_000004/{damaged} is unreadable" in out
    assert "resumed bad from step 2" in out
    assert ckpt.list_steps("bad")[-1] == 6


@pytest.mark.parametrize("damaged", ["model.safetensors", "meta.json"])
def test_loading_a_corrupt_checkpoint_names_the_file_and_suggests_step(base, damaged, capsys):
    from scripts import base_loss, base_sample
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=dmg") == 0
    truncate(os.path.join(ckpt_dir(base, "dmg", 4), damaged))
    with pytest.raises(ckpt.CheckpointError, match=f"step_000004/{damaged} is unreadable.*--step=2"):
        ckpt.load_model("dmg", "latest")
    assert base_sample.main(["--model_tag=dmg", "--device_type=cpu", "--max_tokens=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and damaged in err[0] and "--step=2" in err[0]
    with pytest.raises(SystemExit, match=f"{damaged} is unreadable.*--step=2"):
        base_loss.main(["--model_tag=dmg", "--device_type=cpu"])
    ckpt.load_model("dmg", "2")  # the suggested step loads


def test_full_disk_during_a_save_says_so_cleans_up_and_resume_works(base, monkeypatch, capsys):
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=full") == 0
    real_open = open

    def full_open(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDiskFile(f) if "w" in mode and "step_000004" in str(path) else f

    monkeypatch.setattr(checkpoint_writer, "open", full_open, raising=False)
    before = tree(ckpt_dir(base, "full", 2))
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=full", "--resume") == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no space left on device" in err[0] and "a checkpoint needs ~" in err[0]
    assert "bytes)" in err[0] and "--resume" in err[0]
    assert [d for d in os.listdir(ckpt_dir(base, "full")) if d.startswith("step_")] == ["step_000002"]  # no .tmp
    assert tree(ckpt_dir(base, "full", 2)) == before
    monkeypatch.undo()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    os.makedirs(ckpt_dir(base, "full", 4) + ".tmp")  # as a kill mid-save would leave it
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=full", "--resume") == 0
    assert "removed step_000004.tmp" in capsys.readouterr().out
    assert ckpt.list_steps("full") == [2, 4] and not os.path.exists(ckpt_dir(base, "full", 4) + ".tmp")


def test_a_swapped_tokenizer_is_refused_and_old_checkpoints_warn(base, capsys):
    from nanochat.data.tokenizer import RustBPETokenizer, get_tokenizer, tokenizer_dir
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=tok") == 0
    trained_with, vocab_size = get_tokenizer().fingerprint(), get_tokenizer().get_vocab_size()
    assert ckpt.read_meta("tok", 2)["tokenizer_fingerprint"] == trained_with
    texts = pq.read_table(os.path.join(base, "base_data", "shard_00000.parquet")).column("text").to_pylist()
    other = RustBPETokenizer.train_from_iterator(iter([t[::-1].upper() for t in texts]), 300)
    other.save(tokenizer_dir())
    assert other.get_vocab_size() == vocab_size and other.fingerprint() != trained_with  # same size, other meanings
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load_model("tok", "latest")
    assert trained_with in str(refused.value) and other.fingerprint() in str(refused.value)
    before = tree(ckpt_dir(base, "tok"))
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=tok", "--resume") == 1
    assert trained_with in capsys.readouterr().err
    assert tree(ckpt_dir(base, "tok")) == before
    # a checkpoint from before fingerprints loads, with a warning
    meta_path = os.path.join(ckpt_dir(base, "tok", 2), "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["tokenizer_fingerprint"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    ckpt.load_model("tok", "latest")
    assert "records no tokenizer fingerprint" in capsys.readouterr().out


def test_a_fresh_run_on_a_used_tag_refuses_and_overwrite_moves_it_aside(base, capsys):
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=used") == 0
    before = tree(ckpt_dir(base, "used"))
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=used") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "--resume" in err[0] and "--overwrite" in err[0]
    assert tree(ckpt_dir(base, "used")) == before
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=used", "--overwrite") == 0
    aside = [d for d in os.listdir(os.path.join(base, "base_checkpoints")) if d.startswith("used.replaced-")]
    assert len(aside) == 1
    moved = tree(os.path.join(base, "base_checkpoints", aside[0]))
    assert sorted(os.path.relpath(p, os.path.join(base, "base_checkpoints", aside[0])) for p in moved) == \
        sorted(os.path.relpath(p, ckpt_dir(base, "used")) for p in before)  # every file of the first run, kept
    assert ckpt.list_steps("used") == [2]


def test_disk_preflight_refuses_before_writing(base, monkeypatch, capsys):
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: 1000)
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=room", "--keep_last=2") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not enough disk for checkpoints" in err[0] and "--keep_last=2 keeps up to 4" in err[0]
    assert not os.path.exists(ckpt_dir(base, "room"))


def test_backup_retention_keeps_the_newest_and_the_best(base, tmp_path):
    assert train(*FLAGS, "--save_every=1", "--keep_last=0", "--num_iterations=3", "--model_tag=ret") == 0
    trainer.update_checkpoint_bpb("ret", 1, [0.5, 0.1])  # step 1 becomes the best
    uploads = Backup.location(str(tmp_path / "bucket"), "ret", keep_last=1)
    for step in (1, 2, 3):  # one upload at a time, each waited for
        uploads.start().submit(step)
        uploads.close()
    assert uploads.steps() == [1, 3]
    assert sorted(os.listdir(tmp_path / "bucket" / "ret" / "step_000003")) == sorted(
        os.listdir(ckpt_dir(base, "ret", 3)))


@pytest.mark.parametrize("damage", [b"not json", b"[1, 2]", b'{"val_bpb": "0.01"}', b'{"val_bpb": [NaN]}',
                                    b'{"val_bpb": [true]}', b"[" * 100_000])
def test_backup_retention_reads_a_damaged_remote_meta_as_unscored(tmp_path, damage):
    # the remote copy is outside the run's control: a meta.json that records no number must neither stop the
    # retention (it ran on the upload thread and warned at every save) nor keep a step as the best
    uploads = Backup.location(str(tmp_path / "bucket"), "dmg", keep_last=1)
    for step, bpb in ((1, 0.9), (2, 0.1), (3, 0.5)):
        os.makedirs(uploads.remote(step))
        with open(uploads.remote(step, "meta.json"), "w") as f:
            json.dump({"val_bpb": [bpb]}, f)
    with open(uploads.remote(2, "meta.json"), "wb") as f:  # the best step's record, altered
        f.write(damage)
    assert [uploads.remote_bpb(s) for s in (1, 2, 3)] == [0.9, None, 0.5]
    uploads.prune()
    assert uploads.steps() == [3]  # the newest; step 2 no longer counts as the best, step 1 was never it


@pytest.mark.parametrize("url", ["memory://backup", "local"])
def test_backup_then_resume_from_it_into_an_empty_base_dir(base, base_dir, url, tmp_path, monkeypatch, capsys):
    url = str(tmp_path / "bucket") if url == "local" else url
    flags = [*FLAGS, "--save_every=1", f"--backup_dir={url}"]
    assert train(*flags, "--num_iterations=3", "--model_tag=bk") == 0
    backup = Backup.location(url, "bk")
    assert backup.steps()[-1] == 3  # the run waited for its last upload
    assert "backup: step 3 copied" in capsys.readouterr().out
    # a new machine: the same data and tokenizer, no checkpoints
    fresh = tmp_path / "fresh"
    shutil.copytree(os.path.join(base, "tokenizer"), fresh / "tokenizer")
    os.symlink(os.path.join(base_dir, "base_data"), fresh / "base_data")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(fresh))
    assert train(*flags, "--num_iterations=5", "--model_tag=bk", "--resume") == 0
    out = capsys.readouterr().out
    assert f"restored bk step 3 from the backup {url}" in out and "resumed bk from step 3" in out
    assert backup.steps()[-1] == 5
    # the same run without interruption ends with the same weights
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    assert train(*FLAGS, "--save_every=1", "--num_iterations=5", "--model_tag=straight") == 0
    a, b = weights(base, "straight", 5), weights(str(fresh), "bk", 5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if url.startswith("memory://"):
        backup.fs.rm(backup.dir, recursive=True)


def test_a_failing_backup_warns_and_training_goes_on(base, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=nobk", f"--backup_dir={blocker}/sub") == 0
    assert "WARNING: backup of step 2" in capsys.readouterr().out
    assert ckpt.list_steps("nobk") == [2]


# ---------------------------------------------------------------- files crafted to run code when read

class RunsCode:
    """Pickles as the call open(path, "w"): unpickling it creates path, standing for any code a crafted file runs."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


OPEN = f"{open.__module__}.{open.__name__}"  # the name pickle gives RunsCode's call


def test_a_rank_file_that_would_run_code_is_refused_in_one_line_and_runs_nothing(base, tmp_path, capsys):
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=crafted") == 0  # steps 2 and 4
    marker = tmp_path / "ran"
    rank_file = os.path.join(ckpt_dir(base, "crafted", 4), "rank_0.pt")
    torch.save({"optimizers": [], "rng": RunsCode(marker), "loaders": []}, rank_file)
    before = tree(ckpt_dir(base, "crafted"))
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=crafted", "--resume") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{rank_file} holds something other than tensors and plain data ({OPEN})" in err[0]
    assert "restore the checkpoint from a copy you trust" in err[0]
    assert not marker.exists()
    assert tree(ckpt_dir(base, "crafted")) == before  # nor skipped for step 2: going on would hide the altered file
    with pytest.raises(ckpt.CheckpointError, match="holds something other than tensors"):
        ckpt.load_rank_state("crafted", 4, 0)
    assert not marker.exists()
    torch.load(rank_file, weights_only=False)  # what the loader used to do: the file does run code
    assert marker.exists()


class Placeholder:
    """Pickles as print(command); crafted() renames that global, as an attacker writes any name into the pickle."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return print, (self.command,)


def crafted(path, module, name, command):
    """A torch file whose unpickling calls module.name(command): torch.save of Placeholder, its global renamed (pickle
    itself writes os.system as posix.system, and refuses to pickle a global under another name)."""
    buf = io.BytesIO()
    torch.save({"optimizers": [], "rng": Placeholder(command), "loaders": []}, buf)
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(path, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"c__builtin__\nprint\n", f"c{module}\n{name}\n".encode())
            out.writestr(info.filename, data)


class Tampered:
    """An object of a class no checkpoint holds: what a __reduce__ payload names first."""

    def __reduce__(self):
        return Tampered, ()


# the payloads a weights_only load refuses with torch's "module is blocked" text as well as its "WeightsUnpickler" one
PAYLOADS = [("os", "system"), ("posix", "system"), ("builtins", "exec"), ("tests.test_checkpoint_manager", "Tampered")]


@pytest.mark.parametrize("module, name", PAYLOADS)
def test_every_kind_of_payload_in_a_rank_file_is_reported_as_altered_and_nothing_falls_back(base, tmp_path, capsys,
                                                                                             module, name):
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=payload") == 0  # steps 2 and 4
    marker = tmp_path / "ran"
    rank_file = os.path.join(ckpt_dir(base, "payload", 4), "rank_0.pt")
    command = f"touch {marker}" if name == "system" else f"open({str(marker)!r}, 'w')"
    crafted(rank_file, module, name, command)
    before = tree(ckpt_dir(base, "payload"))
    assert train(*FLAGS, "--num_iterations=6", "--model_tag=payload", "--resume") == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and f"{rank_file} holds something other than tensors and plain data ({module}.{name})" \
        in err[0], err
    assert "altered" in err[0] and "weights_only" not in err[0] and "skipping" not in captured.out
    assert not marker.exists()
    assert tree(ckpt_dir(base, "payload")) == before  # no fallback to step 2, whose next save would overwrite step 4
    with pytest.raises(ckpt.CheckpointError, match="altered"):
        ckpt.load_rank_state("payload", 4, 0)
    if name == "system":  # a real payload: what the loader would run without weights_only
        torch.load(rank_file, weights_only=False)
        assert marker.exists()


def test_a_payload_in_old_model_pt_weights_is_altered_not_damaged_in_sample(base, tmp_path, capsys):
    from scripts import base_sample
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=oldpt") == 0
    step = ckpt_dir(base, "oldpt", 2)
    os.remove(os.path.join(step, "model.safetensors"))
    crafted(os.path.join(step, "model.pt"), "os", "system", f"touch {tmp_path / 'ran'}")
    assert base_sample.main(["--model_tag=oldpt", "--device_type=cpu", "--max_tokens=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(os.system)" in err[0] and "altered" in err[0], err
    assert "weights_only" not in err[0] and "damaged" not in err[0]
    assert not (tmp_path / "ran").exists()


def test_a_rank_file_from_before_plain_rng_states_still_resumes(base):
    """Rank files used to hold numpy's RNG state as it comes, with an ndarray: they load, and restore that state."""
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=oldrng") == 0
    rank_file = os.path.join(ckpt_dir(base, "oldrng", 2), "rank_0.pt")
    state = torch.load(rank_file, weights_only=True)
    np.random.seed(7)
    state["rng"]["numpy"] = np.random.get_state()
    expected = np.random.random()
    torch.save(state, rank_file)
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(rank_file)  # an old file indeed
    np.random.seed(0)
    point = resume.load_resume_point("oldrng", "latest", rank=0)
    model = build_model(point.meta["model_config"], "cpu")
    resume.restore(point, model, setup_optimizers(model))
    assert np.random.random() == expected
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=oldrng", "--resume") == 0


def save_shards(state, directory):
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():  # DCP warns that it writes in one process
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)


def test_a_sharded_index_that_would_run_code_is_refused_and_a_real_one_loads(base, tmp_path, capsys):
    from scripts import base_sample
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=shards") == 0
    step = ckpt_dir(base, "shards", 4)
    expected = weights(base, "shards", 4)
    save_shards({"model": expected, "optim": {"lm_head.weight.step": 3}}, step)  # as --sharding=fsdp writes them
    os.remove(os.path.join(step, "model.safetensors"))
    model, _, _ = ckpt.load_model("shards", "latest")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    marker = tmp_path / "ran"
    index = os.path.join(step, ".metadata")
    with open(index, "wb") as f:
        pickle.dump(RunsCode(marker), f)
    before = tree(ckpt_dir(base, "shards"))
    with pytest.raises(ckpt.CheckpointError, match=f"holds something other than tensors and plain data \\({OPEN}\\)"):
        ckpt.load_model("shards", "latest")
    assert base_sample.main(["--model_tag=shards", "--device_type=cpu", "--max_tokens=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{index} holds something other than tensors and plain data ({OPEN})" in err[0]
    assert not marker.exists() and tree(ckpt_dir(base, "shards")) == before
    with open(index, "rb") as f:
        pickle.load(f)  # what DCP's own reader does: the file does run code
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_value_that_would_run_code_is_refused_and_a_plain_one_loads(tmp_path):
    marker = tmp_path / "ran"
    save_shards({"optim": {"a.step": 3, "b.step": RunsCode(marker)}}, tmp_path / "step")
    state = {"optim": {"a.step": 0}}
    load_shards(state, str(tmp_path / "step"), no_dist=True)
    assert state == {"optim": {"a.step": 3}}
    with pytest.raises(RefusedObject, match=f"{OPEN}, in optim.b.step's value in a .distcp file"):
        load_shards({"optim": {"b.step": 0}}, str(tmp_path / "step"), no_dist=True)
    assert not marker.exists()


@pytest.mark.parametrize("tag", ["../base_data", "../../outside", "/tmp/abs", "..", "a/b", ".hidden"])
def test_a_model_tag_is_a_name_not_a_path(base, tag, capsys):
    from scripts import base_sample
    before = tree(base)
    with pytest.raises(SystemExit) as e:  # the parser's one line, as SystemExit's message (exit status 1)
        base_train.main([*FLAGS, "--num_iterations=2", f"--model_tag={tag}", "--overwrite"])
    assert "\n" not in str(e.value.code) and f"model tag {tag!r} is not a name" in str(e.value.code)
    assert exit_code(base_sample.main, f"--model_tag={tag}", "--device_type=cpu") == 2
    assert f"model tag {tag!r} is not a name" in capsys.readouterr().err
    assert tree(base) == before and os.path.isdir(os.path.join(base, "base_data"))
    with pytest.raises(ckpt.CheckpointError, match="is not a name"):
        ckpt.model_dir(tag)


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_a_sharded_index_naming_shards_outside_the_checkpoint_is_refused(base, tmp_path, where):
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=far") == 0
    step = ckpt_dir(base, "far", 2)
    save_shards({"model": weights(base, "far", 2)}, step)
    os.remove(os.path.join(step, "model.safetensors"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    index = os.path.join(step, ".metadata")
    with open(index, "rb") as f:
        metadata = pickle.load(f)  # the test's own file: trusted
    for info in metadata.storage_data.values():
        moved = elsewhere / info.relative_path
        if not moved.exists():
            shutil.move(os.path.join(step, info.relative_path), moved)
        info.relative_path = str(moved) if where == "absolute" else os.path.relpath(moved, step)
    with open(index, "wb") as f:
        pickle.dump(metadata, f)
    before = tree(ckpt_dir(base, "far"))
    with pytest.raises(ckpt.CheckpointError, match="a shard path .* that is not a file name in the checkpoint "
                                                   "directory.*the file was altered"):
        ckpt.load_model("far", "latest")
    assert tree(ckpt_dir(base, "far")) == before


def malformed(meta, case):
    """meta.json as a hand edit or a crafted file may leave it."""
    config = meta["model_config"]
    return {"top-level list": [meta], "model_config missing": {k: v for k, v in meta.items() if k != "model_config"},
            "model_config a list": {**meta, "model_config": list(config.items())},
            "unknown model_config key": {**meta, "model_config": {**config, "n_wings": 2}},
            "model_config of another type": {**meta, "model_config": {**config, "n_layer": "two"}},
            "data a string": {**meta, "data": "abc"},
            "data without fingerprint": {**meta, "data": {"shards": 1, "dir": "/x"}},
            "batch_geometry a list": {**meta, "batch_geometry": [1, 2]},
            "batch_geometry of strings": {**meta, "batch_geometry": {**meta["batch_geometry"], "world_size": "1"}},
            "val_bpb a number": {**meta, "val_bpb": 3},
            "another model's shape": {**meta, "model_config": {**config, "n_embd": config["n_embd"] * 2}},
            "a context no weights bound": {**meta, "model_config": {**config, "sequence_len": 2 ** 40}}}[case]


@pytest.mark.parametrize("case", ["top-level list", "model_config missing", "model_config a list",
                                  "unknown model_config key", "model_config of another type", "data a string",
                                  "data without fingerprint", "batch_geometry a list", "batch_geometry of strings",
                                  "val_bpb a number", "another model's shape", "a context no weights bound"])
def test_a_malformed_meta_json_is_one_line_everywhere(base, case, capsys):
    from scripts import base_sample
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=meta") == 0
    path = os.path.join(ckpt_dir(base, "meta", 2), "meta.json")
    with open(path) as f:
        meta = json.load(f)
    with open(path, "w") as f:
        json.dump(malformed(meta, case), f)
    capsys.readouterr()
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model("meta", "latest")
    assert "\n" not in str(e.value) and "meta" in str(e.value)
    assert base_sample.main(["--model_tag=meta", "--device_type=cpu", "--max_tokens=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert train(*FLAGS, "--num_iterations=4", "--model_tag=meta", "--resume") == 1  # never a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot resume" in err[0] and "Traceback" not in "\n".join(err), err  # a config refusal lists fields
    assert ckpt.best_step("meta") in (None, 2) and ckpt.list_steps("meta") == [2]


def test_a_partial_save_that_cannot_be_removed_is_not_reported_removed(base, monkeypatch, capsys):
    os.makedirs(os.path.join(ckpt.model_dir("tmpleft"), "step_000004.tmp"))
    os.makedirs(os.path.join(ckpt.model_dir("tmpleft"), "step_000006.tmp"))
    real_rmtree = shutil.rmtree

    def rmtree(path, ignore_errors=False, **kwargs):  # step 4's directory as on a read-only mount
        if not path.endswith("step_000004.tmp"):
            return real_rmtree(path, ignore_errors=ignore_errors, **kwargs)
        if not ignore_errors:
            raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(ckpt.shutil, "rmtree", rmtree)
    ckpt.remove_partial_saves("tmpleft")
    out = capsys.readouterr().out
    assert "removed step_000006.tmp:" in out and "removed step_000004.tmp" not in out
    assert "WARNING: could not remove step_000004.tmp (Permission denied)" in out


# ---------------------------------------------------------------- fuzzing meta.json
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.integers(-3, 70) |
                           st.floats() | st.text(max_size=12),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=3), max_leaves=6)
NESTED = ["model_config", "data", "batch_geometry", "train_config", "early_stop"]


def test_no_meta_json_gets_a_traceback_from_sampling_or_resuming(base, capsys):
    """Hypothesis edits one field of a real meta.json at a time (or the whole document): loading the model gives it
    or one line, and --resume resumes or stops with one line (an exception other than SystemExit fails the test)."""
    assert train(*FLAGS, "--num_iterations=2", "--model_tag=fz") == 0
    path = os.path.join(ckpt_dir(base, "fz", 2), "meta.json")
    with open(path) as f:
        original = json.load(f)
    fields = [(k,) for k in original] + [(k, sub) for k in NESTED if isinstance(original.get(k), dict)
                                         for sub in original[k]] + [(k, "an_unknown_key") for k in NESTED]
    edit = st.tuples(st.sampled_from(fields), st.one_of(st.just("delete"), JSON_VALUES))
    capsys.readouterr()

    @settings(max_examples=40, deadline=None)
    @given(edits=st.lists(edit, min_size=1, max_size=3) | JSON_VALUES)
    def check(edits):
        meta = json.loads(json.dumps(original))
        if isinstance(edits, list) and edits and isinstance(edits[0], tuple):
            for field, value in edits:
                holder = meta
                for key in field[:-1]:
                    if not isinstance(holder.get(key), dict):  # an earlier edit made it a value: an object again
                        holder[key] = {}
                    holder = holder[key]
                if value == "delete":
                    holder.pop(field[-1], None)
                else:
                    holder[field[-1]] = value
        else:
            meta = edits
        with open(path, "w") as f:
            json.dump(meta, f)
        try:
            ckpt.load_model("fz", "latest")
        except ckpt.CheckpointError as e:
            assert "\n" not in str(e)
        assert train(*FLAGS, "--num_iterations=2", "--model_tag=fz", "--resume") in (0, 1)
        assert "Traceback" not in capsys.readouterr().err

    check()
