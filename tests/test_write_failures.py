"""Every write of base_train and base_loss on a full disk or a read-only file system: one line naming the file, why
and what to do, exit 5, no traceback, no temporary file left; and the next run continues and removes what killed
writers left. In this process with monkeypatched writes; on a real small tmpfs where the tests run as root."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from nanochat import trainer
from nanochat.eval.metrics import MetricsLog
from scripts import base_loss, base_train, plot_run
from tests.support import forked
from tests.support.helpers import ROOT, TINY, ckpt_dir, exit_code, private_base_dir, tree
from tests.support.unwritable import FULL, READ_ONLY, dead_pid, fail_writes, one_line, temporaries

FLAGS = TINY + ["--num_iterations=4", "--save_every=2"]  # checkpoints at 2 and 4, evaluation at 4
WHY = {FULL: "no space left on device; free space on that disk", READ_ONLY: "read-only file system; remount it"}


@pytest.fixture
def base(base_dir, tmp_path, monkeypatch):
    return private_base_dir(base_dir, tmp_path, monkeypatch)


run = exit_code


def break_at(mp, owner, attr, under, code, name, when=lambda *args: True):
    """When owner.attr is next called with arguments for which `when` holds, writes of files named name* under
    `under` start to fail with errno code (the disk fills up, the file system turns read-only)."""
    real = getattr(owner, attr)

    def hooked(*args, **kwargs):
        if when(*args):
            fail_writes(mp, under, code, name)
        return real(*args, **kwargs)

    mp.setattr(owner, attr, hooked)


# (the file, what writes it, called when, how it fails): a run's writes in the order they fall due; all but the log go
# through files.atomic_write_bytes, so both kinds of failure meet that path (the message per kind: WHY)
RUN_WRITES = [
    ("metrics.jsonl", MetricsLog, "log", lambda log, record: record["step"] == 3, FULL),  # between checkpoints 2, 4
    ("summary.json", trainer, "write_summary", lambda *args: True, READ_ONLY),
    ("report.md", trainer, "write_summary", lambda *args: True, FULL),
    ("meta.json", trainer, "update_checkpoint_bpb", lambda *args: True, READ_ONLY),
]


def test_each_failed_write_of_a_run_is_one_line_exit_5_and_the_next_resume_gets_past_it(base, capsys):
    """One run whose writes fail one after another: each failure stops it with one line, exit 5 and no temporary
    file; the resume after it gets past that write and meets the next failure, and the last resume finishes."""
    run_dir = ckpt_dir(base, "w")
    for i, (name, owner, attr, when, code) in enumerate(RUN_WRITES):
        with pytest.MonkeyPatch.context() as mp:
            break_at(mp, owner, attr, run_dir, code, name, when)
            assert run(base_train.main, *FLAGS, "--model_tag=w", *(["--resume"] if i else [])) == 5, name
        err = capsys.readouterr().err
        assert one_line(err) and err.startswith(f"base_train: cannot write {run_dir}/"), err
        assert f"{name}: {WHY[code]}" in err, err
        assert err.endswith("then run the same command with --resume (the checkpoints saved so far are intact)\n")
        assert temporaries(run_dir) == [], name
    assert run(base_train.main, *FLAGS, "--model_tag=w", "--resume") == 0  # the disk has room again
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["step"] == 4
    with open(os.path.join(ckpt_dir(base, "w", 4), "meta.json")) as f:
        assert json.load(f)["val_bpb"] is not None
    assert os.path.exists(os.path.join(run_dir, "report.md")) and temporaries(run_dir) == []


def test_resume_into_an_unwritable_run_directory_stops_before_resuming_and_changes_nothing(base, capsys):
    assert run(base_train.main, *TINY, "--num_iterations=2", "--model_tag=ro") == 0
    run_dir = ckpt_dir(base, "ro")
    before = tree(run_dir)
    for code in (READ_ONLY, FULL):
        capsys.readouterr()
        with pytest.MonkeyPatch.context() as mp:
            fail_writes(mp, run_dir, code)
            assert run(base_train.main, *TINY, "--num_iterations=4", "--model_tag=ro", "--resume") == 5, code
        out, err = capsys.readouterr()
        assert one_line(err) and err.startswith("base_train: cannot write ") and WHY[code] in err, err
        assert "resumed" not in out or code == FULL  # a full disk is met by the first write after resuming
        assert tree(run_dir) == before, code


def test_the_next_run_removes_what_killed_writers_left_in_its_directory_and_nothing_else(base, capsys):
    assert run(base_train.main, *FLAGS, "--model_tag=stale") == 0
    run_dir, dead, live = ckpt_dir(base, "stale"), dead_pid(), os.getppid()  # the parent: alive, not this process
    left = [os.path.join(run_dir, f"summary.json.tmp{dead}"), os.path.join(run_dir, f"base_loss_step000004.json.tmp"
                                                                                   f"{dead}"),
            os.path.join(ckpt_dir(base, "stale", 2), f"meta.json.tmp{dead}")]
    writing_now = os.path.join(run_dir, f"report.md.tmp{live}")  # a live process's: never touched
    for path in left + [writing_now]:
        open(path, "wb").close()
    capsys.readouterr()
    assert run(base_train.main, *TINY, "--num_iterations=6", "--save_every=2", "--model_tag=stale", "--resume") == 0
    removed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("removed 3 temporary")]
    assert len(removed) == 1 and all(path in removed[0] for path in left)
    assert temporaries(run_dir) == [writing_now]


def test_base_loss_prints_its_results_then_one_line_when_it_cannot_save_them(base, capsys):
    assert run(base_train.main, *TINY, "--num_iterations=2", "--model_tag=done") == 0
    trained = ckpt_dir(base, "done")
    for code in (FULL, READ_ONLY):
        stale = os.path.join(trained, f"base_loss_step000002.json.tmp{dead_pid()}")
        open(stale, "wb").close()
        capsys.readouterr()
        with pytest.MonkeyPatch.context() as mp:
            fail_writes(mp, trained, code, "base_loss_step")
            assert run(base_loss.main, "--model_tag=done", "--split_tokens=256", "--device_type=cpu") == 5, code
        out, err = capsys.readouterr()
        assert "val   bpb per step" in out and one_line(err), err
        assert err.startswith(f"base_loss: cannot write {trained}/base_loss_step000002.json: {WHY[code]}"), err
        assert "run base_loss again to save the results printed above" in err
        assert temporaries(trained) == []  # its own and the dead writer's
    assert run(base_loss.main, "--model_tag=done", "--split_tokens=256", "--device_type=cpu") == 0
    assert os.listdir(trained).count("base_loss_step000002.json") == 1


# ---------------------------------------------------------------------------------------------------- a real disk
@pytest.fixture
def tmpfs(tmp_path):
    """A 4 MB tmpfs (root only), unmounted afterwards."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                                           capture_output=True, timeout=30).returncode:
        pytest.skip("a real tmpfs needs root and mount; the monkeypatched tests above cover the same writes")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], timeout=30)


def script(base, module, *argv, timeout=300):
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return forked.run([sys.executable, "-m", module, *argv], timeout=timeout, cwd=ROOT, env=env)


def test_a_real_full_disk_and_a_real_read_only_mount_give_one_line_and_exit_5(base_dir, tmpfs, monkeypatch, capsys):
    shutil.copytree(os.path.join(base_dir, "tokenizer"), tmpfs / "tokenizer")
    os.symlink(os.path.join(base_dir, "base_data"), tmpfs / "base_data")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmpfs))  # in process but the last: the disk is as real either way
    assert run(base_train.main, *FLAGS, "--model_tag=r") == 0
    filler = tmpfs / "filler"
    assert os.path.ismount(tmpfs)  # the filler must never reach a shared disk: at most 5 MB, on the tmpfs only
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=4k", "count=1280"], capture_output=True, timeout=60)
    for main, argv, file in [(base_loss.main, ["--model_tag=r", "--split_tokens=256", "--device_type=cpu"],
                              "r/base_loss_step000004.json"),
                             (plot_run.main, ["r"], "r/training.png")]:
        capsys.readouterr()
        assert run(main, *argv) == 5
        err = capsys.readouterr().err
        assert one_line(err) and f"{file}: no space left on device" in err, err
    filler.unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True, timeout=30)
    # a real process on the real read-only mount: its exit status and stderr as a user sees them
    done = script(tmpfs, "scripts.base_train", *TINY, "--num_iterations=6", "--model_tag=r", "--resume")
    assert done.returncode == 5 and one_line(done.stderr) and "resumed" not in done.stdout
    assert "base_train: cannot write" in done.stderr and "read-only file system" in done.stderr
    subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True, timeout=30)
    assert temporaries(str(tmpfs)) == []
