"""nanochat/common.py and nanochat/files.py: what every entry point shares; the peak-FLOPs table, where each GPU's
exact device name finds its own datasheet figure, never a sibling's; failed writes described in one line, and stale
temporary files."""

import errno
import os
import sys

import pytest
import torch
import tqdm.std

from nanochat import common
from nanochat.common import cpu_threads, free_threads, gpu_peak_flops, progress_bar, quota_cores
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


def test_progress_bar_on_a_terminal_and_on_rank_0_only(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert not progress_bar(range(3)).disable
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):  # as torchrun sets them
        monkeypatch.setenv(name, value)
    assert progress_bar(range(3)).disable
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress_bar(range(3)).disable


def test_progress_in_a_log_is_a_plain_line_every_few_seconds_with_an_eta(monkeypatch, capsys):
    clock = [1000.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: clock[0])  # tqdm's clock, read as each bar starts
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a log file
    for _ in progress_bar(range(20), desc="evaluating", unit="batch", delay=3, leave=False):
        clock[0] += 4.0  # a batch takes 4 s: 80 s in all
    for _ in progress_bar(range(4), desc="short"):
        clock[0] += 2.0  # 8 s: no line
    err = capsys.readouterr().err
    assert "\r" not in err and "short" not in err
    lines = err.splitlines()
    assert len(lines) == 6  # a line each time 10 s have passed since the last, at 12, 24, ... 72 s
    assert lines[0] == "evaluating: 3/20 batch (15%), 00:12 elapsed, eta 01:08"
    assert lines[-1] == "evaluating: 18/20 batch (90%), 01:12 elapsed, eta 00:08"


# ---------------------------------------------------------------------------------------------------- CPU threads
@pytest.mark.parametrize("cap,busy,threads", [(2, 0.0, 2), (2, 0.2, 2), (2, 0.3, 1), (2, 0.5, 1), (2, 1.0, 1),
                                               (16, 0.25, 12), (16, 1.0, 1), (4, None, 4)])
def test_free_threads_leave_out_every_core_that_is_half_busy_or_more(cap, busy, threads):
    assert free_threads(cap, busy) == threads  # 2 x 0.3 = 0.6 of a core busy: taken; 2 x 0.2 = 0.4: free


def stat(cpu0, cpu1, cpu2=(0, 0)):
    """A /proc/stat whose cpu0..2 have spent (busy, idle) ticks; the machine-wide line and one other kept."""
    line = lambda name, busy, idle: f"{name} {busy} 0 0 {idle} 0 0 0 0 0 0\n"  # noqa: E731
    return (line("cpu", 999, 999) + line("cpu0", *cpu0) + line("cpu1", *cpu1) + line("cpu2", *cpu2) +
            "intr 12345 0 0\n")


def test_busy_share_is_the_non_idle_time_of_the_allowed_cpus_only(tmp_path):
    path = tmp_path / "stat"
    path.write_text(stat((100, 100), (100, 100), (0, 0)))
    later = stat((100 + 25, 100), (100 + 5, 100 + 20), (50, 0))  # cpu0 all busy, cpu1 a fifth; cpu2 not ours
    share = common.busy_share({0, 1}, seconds=0.25, stat=str(path), sleep=lambda s: path.write_text(later))
    assert share == pytest.approx((25 + 5) / (25 + 25))
    assert common.busy_share({0}, stat=str(tmp_path / "absent"), sleep=lambda s: None) is None  # not Linux


@pytest.mark.parametrize("files,cores", [({"cpu.max": "200000 100000"}, 2), ({"cpu.max": "max 100000"}, None),
                                         ({"cpu.max": "50000 100000"}, 1),
                                         ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4),
                                         ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
                                         ({}, None)])
def test_a_containers_cpu_quota_is_read_from_cgroup_v2_or_v1(tmp_path, files, cores):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert quota_cores(str(tmp_path)) == cores


def test_cpu_threads_take_the_flag_then_omp_num_threads_then_the_free_cores(monkeypatch):
    def no_watch(cpus):
        raise AssertionError("the machine was watched where nothing was to be chosen")
    monkeypatch.setattr(common, "allowed_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(common, "quota_cores", lambda: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # torch's default: the physical cores
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2, share=no_watch) == (2, "--threads")
    assert cpu_threads(None, share=no_watch) == (4, "OMP_NUM_THREADS")  # what torch read from it
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_threads(None, share=lambda cpus: 0.0) == (4, "4 cores allowed, 0% busy with other work")
    assert cpu_threads(None, share=lambda cpus: 0.5)[0] == 2  # two of four cores busy
    assert cpu_threads(None, share=lambda cpus: None) == (4, "4 cores allowed")  # no /proc/stat
    monkeypatch.setattr(common, "quota_cores", lambda: 1)  # docker --cpus=1 on a 4-core machine
    assert cpu_threads(None, share=no_watch) == (1, "4 cores allowed, a quota of 1")


def test_the_threads_flag_is_checked_with_the_others():
    from nanochat.train import config as train_config
    with pytest.raises(SystemExit, match="--threads=0 must be >= 1"):
        train_config.parse_args(["--depth=2", "--device_type=cpu", "--threads=0"], check_hardware=False)
    assert train_config.parse_args(["--depth=2", "--device_type=cpu", "--threads=3"], check_hardware=False).threads == 3


def test_use_cpu_threads_sets_torch_and_says_so_in_one_line():
    line = common.use_cpu_threads(1)
    assert torch.get_num_threads() == 1
    assert line.startswith("CPU threads: 1 (--threads; ") and "\n" not in line


def test_the_shell_pipelines_get_the_count_on_stdout_and_the_reason_on_stderr(monkeypatch, capsys):
    from dev import threads
    monkeypatch.setattr(common, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(common, "quota_cores", lambda: None)
    monkeypatch.setattr(common, "busy_share", lambda cpus, **kw: 1.0)  # another process on each core
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads.main([])
    out, err = capsys.readouterr()
    assert out == "1\n"
    assert err == "CPU threads: 1 (2 cores allowed, 100% busy with other work; OMP_NUM_THREADS=N sets it)\n"


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
