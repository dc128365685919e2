"""The GPU check kit: every check runs at CPU size and passes, a failing check fails the run and nothing else."""

import dataclasses
import json
import os
import sys

import pytest

from dev import gpu_check
from tests.support import forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_NAMES = {"environment", "peak_flops", "torch_lock", "allocator", "attention", "kv_cache_dtype",
               *(f"{model}_{what}" for model in ("plain", "trm") for what in ("step", "memory", "recompiles",
                                                                             "graph_breaks")),
               "nanochat_compare", "trm_bf16_state"}
CHECK_NAMES = QUICK_NAMES | {"tiny_compile", "train_run", "train_resume", "kv_cache_logits", "decode", "export_hf"}


def read_report(out):
    with open(os.path.join(out, "report.json")) as f:
        return json.load(f)


def run_kit(out, *flags):
    """dev.gpu_check --device cpu as a process (forked from the torch-preloaded server): every check it ran passed,
    each in the report, the table and stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    proc = forked.run([sys.executable, "-m", "dev.gpu_check", "--device", "cpu", "--out", str(out), *flags],
                      timeout=480, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = read_report(out)
    assert all(set(check) == {"name", "ok", "value", "expected"} for check in report["checks"])
    assert all(check["ok"] for check in report["checks"])
    assert report["environment"]["torch"]
    table = (out / "report.md").read_text()
    assert all(f"| {check['name']} | ok |" in table and f"| {check['name']} | ok |" in proc.stdout
               for check in report["checks"])  # the table is printed too
    assert not (out / "work").exists()
    return {check["name"] for check in report["checks"]}


def test_the_quick_kit_passes_at_cpu_size(tmp_path):
    """The facts and the micro-steps end to end in CI; the whole kit: the slow test below."""
    assert run_kit(tmp_path / "report", "--quick") == QUICK_NAMES


# the stages past --quick are each checked in CI elsewhere: train_run and train_resume (torchrun base_train, stopped
# and resumed) by test_launch's test_end_to_end_on_cpu_stopped_and_run_again and test_base_train's
# test_sigkill_then_resume_is_bit_identical; kv_cache_logits and decode by test_engine's
# test_cached_decoding_matches_full_forward and its generation tests; export_hf by test_export_hf's
# test_transformers_logits_equal_ours_at_every_supervision_step; tiny_compile's capture by test_gpt's compile tests
# (inductor: test_gpt's slow ones)
@pytest.mark.slow  # a minute and more on 2 cores: the kit's wrappers of stages checked in CI as listed above
def test_every_check_passes_at_cpu_size(tmp_path):
    out = tmp_path / "report"
    assert run_kit(out) == CHECK_NAMES
    assert (out / "logs" / "base_train_resume.log").exists()


def test_a_failing_check_fails_the_run_and_the_others_still_run(tmp_path, monkeypatch):
    def check_broken(ctx):
        raise ValueError("the accelerator caught fire\nsecond line")

    for name in ("NANOCHAT_BASE_DIR", "HF_MODULES_CACHE"):  # main sets them: restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu_check, "CHECKS", [gpu_check.check_environment, check_broken, gpu_check.check_peak_flops])
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 1
    checks = read_report(tmp_path)["checks"]
    assert [c["name"] for c in checks] == ["environment", "broken", "peak_flops"]
    assert [c["ok"] for c in checks] == [True, False, True]
    assert checks[1]["value"] == "ValueError: the accelerator caught fire"
    assert "| broken | FAIL | ValueError: the accelerator caught fire | runs |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "work").is_dir()  # kept to look into


def test_all_checks_passing_exits_zero(tmp_path, monkeypatch):
    for name in ("NANOCHAT_BASE_DIR", "HF_MODULES_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(gpu_check, "CHECKS", [gpu_check.check_environment, gpu_check.check_nanochat])
    assert gpu_check.main(["--device", "cpu", "--out", str(tmp_path)]) == 0
    assert read_report(tmp_path)["checks"][1]["value"].startswith("not given")


def test_a_pipe_in_a_value_does_not_break_the_markdown_table():
    report = {"environment": {"device": "cpu"}, "device_type": "cpu", "created": "now", "wall_s": 1.0,
              "checks": [gpu_check.row("gap", True, "max |a - b| = 0", "<= 1")]}
    assert "| gap | ok | max \\|a - b\\| = 0 | <= 1 |" in gpu_check.markdown(report)


@pytest.mark.parametrize("argv,message", [
    (["--device", "cuda"], "torch sees no CUDA device"),
    (["--device", "cpu", "--nanochat", "/nonexistent"], "no nanochat/gpt.py there"),
])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(argv + ["--out", str(out)])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "a_file"
    path.write_text("mine")
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--out", str(path)])
    assert "is a file" in capsys.readouterr().err
    assert path.read_text() == "mine"


FAKE_NANOCHAT_GPT = '''
from dataclasses import dataclass
import torch
import torch.nn.functional as F

@dataclass
class GPTConfig:
    sequence_len: int = 8
    vocab_size: int = 8
    n_layer: int = 1
    n_head: int = 1
    n_kv_head: int = 1
    n_embd: int = 8
    window_pattern: str = "SSSL"

class GPT(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.window_pattern == "L", "the comparison must run full-context attention"
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def init_weights(self):
        torch.nn.init.normal_(self.wte.weight)

    def setup_optimizer(self):  # HEAD's one optimizer; the step times it too
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def forward(self, idx, targets):
        from nanochat.helper import twice  # imported while torch.compile traces, as nanochat's flash_attn is
        logits = self.lm_head(twice(self.wte(idx)))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''


def test_nanochat_compare_times_the_checkout_beside_ours(tmp_path, monkeypatch):
    checkout = tmp_path / "nanochat_checkout"
    (checkout / "nanochat").mkdir(parents=True)
    (checkout / "nanochat" / "__init__.py").write_text("")
    (checkout / "nanochat" / "gpt.py").write_text(FAKE_NANOCHAT_GPT)
    (checkout / "nanochat" / "helper.py").write_text("def twice(x):\n    return 2 * x\n")
    ctx = gpu_check.Context(gpu_check.torch.device("cpu"), gpu_check.SIZES["cpu"], str(tmp_path), str(checkout))
    ctx.results["plain"] = {"batch": 2, "step_s": 1e-9}  # ours "infinitely fast": the ratio must pass
    result = gpu_check.check_nanochat(ctx)
    assert result["name"] == "nanochat_compare" and result["ok"], result
    assert 0 < ctx.results["nanochat"]["ours_over_theirs"] < 1
    from nanochat.model import gpt  # ours is back in place
    assert hasattr(gpt, "STATE_UPDATES")
    ctx.results["plain"]["step_s"] = 1e9  # ours far slower: the check fails (their step as timed above)
    timed = ctx.results["nanochat"]
    monkeypatch.setattr(gpu_check, "time_nanochat_step", lambda *args: (timed["step_s"], {"compute_dtype": None}))
    assert not gpu_check.check_nanochat(ctx)["ok"]


def cpu_context(tmp_path):
    return gpu_check.Context(gpu_check.torch.device("cpu"), gpu_check.SIZES["cpu"], str(tmp_path), None)


def test_the_quick_kit_trains_no_tokenizer_and_keeps_the_facts_and_the_three_steps():
    names = [check.__name__.removeprefix("check_") for check in gpu_check.QUICK]
    assert names == ["environment", "peak_flops", "torch_lock", "allocator", "attention", "kv_cache_dtype", "plain",
                     "nanochat", "trm", "trm_bf16_state"]
    assert set(gpu_check.QUICK) < set(gpu_check.CHECKS)


def test_the_bf16_state_step_is_compared_with_the_float32_states(tmp_path, monkeypatch):
    ctx = cpu_context(tmp_path)
    [skipped] = gpu_check.check_trm_bf16_state(ctx)  # float32 at CPU size: nothing to compare
    assert skipped["ok"] and skipped["value"].startswith("not run: a bf16 state needs bf16 autocast")
    measured = lambda tok_per_s, peak, batch, loss: {
        "batch": batch, "activation_checkpointing": False, "sequence_len": 2048, "first_step_s": 30.0,
        "compile_scope": "layer", "head_chunks": 1,
        "step_s": batch * 2048 / tok_per_s, "fwd_bwd_s": 1.0, "tok_per_s": tok_per_s, "mfu": 0.4,
        "losses": [loss, loss], "peak_memory_bytes": peak, "estimated_memory_bytes": 2 * peak, "graphs_compiled": 3,
        "recompiles": 0, "graph_breaks": 0}
    states = []
    monkeypatch.setattr(gpu_check, "run_micro_steps", lambda ctx, config: states.append(config.state_dtype)
                        or measured(60_000.0, 40e9, 32, 11.02))
    ctx = gpu_check.Context(ctx.device, dataclasses.replace(ctx.sizes, dtype="bfloat16"), str(tmp_path), None)
    ctx.results["trm"] = measured(48_000.0, 50e9, 16, 11.0)  # the float32 state's step, measured just before
    rows = gpu_check.check_trm_bf16_state(ctx)
    assert states == ["bfloat16"]  # only the bf16 state is stepped again
    assert [r["name"] for r in rows] == [f"trm_bf16_state_{w}" for w in ("step", "memory", "recompiles",
                                                                        "graph_breaks")] + ["trm_bf16_state_vs_fp32"]
    assert rows[-1]["value"] == "tokens/s 1.25x, peak memory 0.80x, batch 32 vs 16, first loss 11.0200 vs 11.0000"


def test_the_facts_at_cpu_size(tmp_path):
    ctx = cpu_context(tmp_path)
    lock, alloc = gpu_check.check_torch_lock(ctx), gpu_check.check_allocator(ctx)
    attention, kv = gpu_check.check_attention(ctx), gpu_check.check_kv_cache_dtype(ctx)
    assert lock["ok"] and "2.13.0" in lock["value"] or gpu_check.torch.__version__.startswith("2.11")
    assert alloc["ok"] and alloc["value"].startswith("not applicable on cpu")
    assert attention["ok"] and ctx.results["attention"]["default"] in ("flash", "math")
    timings = ctx.results["attention"]["fwd_bwd_s"]
    assert isinstance(timings["math"], float) and str(timings["cudnn"]).startswith("not available")
    assert kv["ok"] and ctx.results["kv_cache_dtype"] == "torch.float32"


@pytest.mark.parametrize("segments,expected", [
    ([{"is_expandable": True, "total_size": 2**21}], True),
    ([{"is_expandable": True}, {"is_expandable": False}], False),
    ([{"total_size": 2**21}], None),  # a torch whose snapshot does not say
])
def test_expandable_segments_read_off_a_memory_snapshot(segments, expected):
    assert gpu_check.expandable_segments(segments) is expected


def test_an_older_torch_than_pyproject_allows_fails_the_lock_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check.torch, "__version__", "2.10.1+cu128")
    row = gpu_check.check_torch_lock(cpu_context(tmp_path))
    assert not row["ok"] and "lock has 2.13.0" in row["value"]


def test_subprocesses_keep_the_callers_pythonpath(tmp_path, monkeypatch):
    """Wheels installed to a --target directory (the GPU machine has no network) reach the kit's subprocesses."""
    monkeypatch.setenv("PYTHONPATH", "/opt/carried-wheels")
    ctx = cpu_context(tmp_path)
    gpu_check.run_process(ctx, ["-c", "import os; print(os.environ['PYTHONPATH'])"], "pythonpath")
    printed = (tmp_path / "logs" / "pythonpath.log").read_text().strip().split(os.pathsep)
    assert printed == [ROOT, "/opt/carried-wheels"]
