"""nanochat/common.py: what every entry point shares; the peak-FLOPs table, where each GPU's exact device name finds
its own datasheet figure, never a sibling's."""

import sys

import pytest

from nanochat.common import LAUNCH_TABLE_DEVICES, gpu_peak_flops, progress_bar

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
]


@pytest.mark.parametrize("name,tflops", DATASHEET)
def test_each_device_name_gets_its_own_datasheet_figure(name, tflops):
    assert gpu_peak_flops(name) == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name", ["cpu", "", "NVIDIA H100", "H100", "NVIDIA H100 80GB HBM3 (MIG 1g.10gb)",
                                  "NVIDIA GH100 PCIe", "Tesla V100-SXM2-16GB", "AMD Instinct MI300X"])
def test_names_not_in_the_table_give_none_so_no_mfu_is_shown(name):
    assert gpu_peak_flops(name) is None


def test_the_launch_table_rows_are_sxm_boards():
    from scripts.launch import HARDWARE
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
