"""nanochat/common.py and nanochat/files.py: what every entry point shares; the peak-FLOPs table, where each GPU's
exact device name finds its own datasheet figure, never a sibling's; failed writes described in one line, and stale
temporary files."""

import errno
import os
import sys

import pytest

from nanochat.common import gpu_peak_flops, progress_bar
from nanochat.files import (
    WriteError,
    atomic_write_bytes,
    check_writable,
    exit_on_write_error,
    remove_stale_temporaries,
    write_error,
    write_failure,
)
from tests.support.unwritable import FULL, READ_ONLY, dead_pid, fail_writes, one_line

# (torch.cuda.get_device_name, dense bf16 TFLOP/s from the vendor's datasheet)
DATASHEET = [
    ("NVIDIA H100 80GB HBM3", 989),  # SXM5
    ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835),
    ("NVIDIA H200", 989),
    ("NVIDIA H200 NVL", 835),
    ("NVIDIA B200", 2250),
    ("NVIDIA GB200", 2500),
    ("NVIDIA A100-SXM4-80GB", 312),
    ("NVIDIA A100-SXM4-40GB", 312),
    ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA A100-PCIE-40GB", 312),
    ("NVIDIA L40S", 362),
    ("NVIDIA A10G", 70),
    ("NVIDIA GeForce RTX 4090", 165),
    ("NVIDIA GeForce RTX 3090", 71),
    ("NVIDIA GH200 480GB", 989),  # as torch.cuda.get_device_name reports them
    ("NVIDIA GH200 144G HBM3e", 989),
    ("NVIDIA H800", 989),
    ("NVIDIA H800 80GB HBM3", 989),
    ("NVIDIA H800 PCIe", 756),
]


@pytest.mark.parametrize("name,tflops", DATASHEET)
def test_each_device_name_gets_its_own_datasheet_figure(name, tflops):
    assert gpu_peak_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["cpu", "", "NVIDIA H100", "H100", "NVIDIA H100 80GB HBM3 (MIG 1g.10gb)",
                                  "NVIDIA GH100 PCIe", "Tesla V100-SXM2-16GB", "AMD Instinct MI300X"])
def test_names_not_in_the_table_give_none_so_no_mfu_is_shown(name):
    assert gpu_peak_flops(name) is None


def test_the_launch_table_rows_are_sxm_boards():
    from scripts.launch import HARDWARE, LAUNCH_TABLE_DEVICES
    expected = {"H100": 989, "H200": 989, "B200": 2250, "A100": 312}
    assert {row["gpu"] for row in HARDWARE.values()} <= set(LAUNCH_TABLE_DEVICES)
    for model, tflops in expected.items():
        assert gpu_peak_flops(LAUNCH_TABLE_DEVICES[model]) == pytest.approx(tflops * 1e12)


def test_progress_bar_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_bar(range(3)).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not progress_bar(range(3)).disable
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):  # as torchrun sets them
        monkeypatch.setenv(name, value)
    assert progress_bar(range(3)).disable


# ---------------------------------------------------------------------------------------------------- failed writes
@pytest.mark.parametrize("code,says", [(FULL, "no space left on device; free space on that disk, then resume"),
                                       (READ_ONLY, "read-only file system; remount it writable, then resume")])
def test_a_failed_atomic_write_names_file_reason_and_fix_and_removes_its_temporary_file(tmp_path, monkeypatch, code,
                                                                                         says):
    path = tmp_path / "summary.json"
    path.write_bytes(b"old")
    fail_writes(monkeypatch, tmp_path, code)
    with pytest.raises(WriteError) as failure:
        atomic_write_bytes(str(path), b"new", ", then resume")
    assert str(failure.value) == f"cannot write {path}: {says}"
    assert failure.value.errno == code and failure.value.exit_code == 5
    assert os.listdir(tmp_path) == ["summary.json"] and path.read_bytes() == b"old"  # no temporary file, old intact


def test_native_writers_errors_are_recognised_by_the_system_message():
    from safetensors import SafetensorError
    error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(error) == ("no space left on device", "free space on that disk")
    assert write_failure(OSError(errno.EACCES, "Permission denied"))[0] == "permission denied"
    assert write_failure(ValueError("a bug, not a write")) is None


def test_stale_temporaries_of_dead_writers_go_and_those_of_live_ones_stay(tmp_path, capsys):
    dead, live = dead_pid(), os.getpid()
    (tmp_path / f"report.md.tmp{dead}").write_bytes(b"")
    (tmp_path / f"out.tmp{dead}").mkdir()
    (tmp_path / f"out.tmp{dead}" / "model.safetensors").write_bytes(b"half")
    for kept in (f"summary.json.tmp{live}", "step_000004.tmp", "notes.tmpfile"):
        (tmp_path / kept).write_bytes(b"")
    removed = remove_stale_temporaries(os.path.join(str(tmp_path), "*"))
    assert sorted(os.path.basename(p) for p in removed) == [f"out.tmp{dead}", f"report.md.tmp{dead}"]
    assert sorted(os.listdir(tmp_path)) == ["notes.tmpfile", "step_000004.tmp", f"summary.json.tmp{live}"]
    out = capsys.readouterr().out
    assert one_line(out) and out.startswith("removed 2 temporary file(s) left by stopped processes:")


def test_an_atomic_write_first_removes_what_a_killed_writer_of_the_same_file_left(tmp_path):
    dead = dead_pid()
    (tmp_path / f"training.png.tmp{dead}").write_bytes(b"")
    (tmp_path / f"other.png.tmp{dead}").write_bytes(b"")  # another file's: not this write's business
    atomic_write_bytes(str(tmp_path / "training.png"), b"png")
    assert sorted(os.listdir(tmp_path)) == [f"other.png.tmp{dead}", "training.png"]


def test_check_writable_refuses_a_read_only_directory_and_leaves_nothing(tmp_path, monkeypatch):
    check_writable(str(tmp_path / "run" / "not yet made"))  # checks the parent it will be made in
    monkeypatch.chdir(tmp_path)
    check_writable(os.path.join("relative", "base"))  # NANOCHAT_BASE_DIR may be relative
    assert os.listdir(tmp_path) == []
    fail_writes(monkeypatch, tmp_path, READ_ONLY)
    with pytest.raises(WriteError, match=f"cannot write {tmp_path}: read-only file system"):
        check_writable(str(tmp_path / "run"))
    assert os.listdir(tmp_path) == []


def test_exit_on_write_error_is_one_line_and_exit_5(capsys):
    with pytest.raises(SystemExit) as stop, exit_on_write_error("plot_run"):
        raise write_error("/x/training.png", OSError(errno.ENOSPC, "No space left on device"),
                          ", or pick another --out")
    assert stop.value.code == 5
    err = capsys.readouterr().err
    assert err == ("plot_run: cannot write /x/training.png: no space left on device; free space on that disk, or pick "
                   "another --out\n")
