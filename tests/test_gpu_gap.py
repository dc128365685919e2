"""The step-gap script (dev/gpu_gap.py) on CPU at a toy size: ours and a stand-in HEAD timed part by part with the same
syncs, profiled, the JSON rewritten after every variant, a budget that starts nothing past it, bad flags one line."""

import json

import pytest
import torch

from dev import gpu_gap

FAKE_HEAD_GPT = '''
from dataclasses import dataclass
import torch
import torch.nn.functional as F
from nanochat.common import COMPUTE_DTYPE

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
        self.config = config
        self.wte = torch.nn.Embedding(config.vocab_size, config.n_embd)
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def init_weights(self):
        torch.nn.init.normal_(self.wte.weight)

    def setup_optimizer(self):  # HEAD's one optimizer
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def estimate_flops(self):
        return 6 * self.lm_head.weight.numel()

    def forward(self, idx, targets):
        from nanochat.flash_attention import attend  # imported while it runs, as HEAD's flash_attn is
        x = self.wte(idx).to(COMPUTE_DTYPE)
        logits = self.lm_head(attend(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
'''

FAKE_FLASH_ATTENTION = '''
import torch.nn.functional as F
HAS_FA3 = False
USE_FA3 = False

def attend(x):
    q = x.unsqueeze(1)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)
'''


@pytest.fixture
def fake_head(tmp_path):
    """A checkout as dev/gpu_carry.sh --model-only leaves it: five files of a GPT with HEAD's interface."""
    package = tmp_path / "carry" / "nanochat"
    package.mkdir(parents=True)
    files = {"__init__.py": "", "gpt.py": FAKE_HEAD_GPT, "flash_attention.py": FAKE_FLASH_ATTENTION,
             "common.py": "import torch\nCOMPUTE_DTYPE = torch.float32\n", "optim.py": ""}
    for name, text in files.items():
        (package / name).write_text(text)
    (tmp_path / "carry" / "COMMIT").write_text("0123abc\n")
    return str(tmp_path / "carry")


# ours three ways and HEAD's; issue 57's recipes: the new default (4 steps' activations alive) at the plan's
# recompute-or-accumulate choice, its recomputing side, and the detached recipe before it (gpt.py's default TRM,
# trm_fp32, steps as trm_holding does: the same ours())
VARIANTS = "plain_layer_16,head_native,plain_model_1,trm_holding,trm_holding_recompute,trm_detached"


def test_ours_and_head_are_timed_alike_the_recipes_at_their_planned_batches_and_the_json_rewritten_after_each(
        tmp_path, fake_head, monkeypatch):
    monkeypatch.setattr(gpu_gap, "TIMED", 2)  # the GPU's median of 10; the plumbing needs fewer here
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("a CUDA call on the CPU"))
    snapshots, write = [], gpu_gap.write
    monkeypatch.setattr(gpu_gap, "write", lambda out, report: snapshots.append(list(report["variants"])) or
                        write(out, report))
    out = tmp_path / "gap"
    assert gpu_gap.main(["--device", "cpu", "--size", "toy", "--backend", "eager", "--nanochat", fake_head,
                         "--variants", VARIANTS, "--out", str(out)]) == 0
    names = VARIANTS.split(",")
    assert snapshots[:len(names)] == [names[:i + 1] for i in range(len(names))]  # a timeout keeps the ones before
    report = json.loads((out / "gap.json").read_text())
    assert list(report["variants"]) == names and not report["skipped"]
    for name, v in report["variants"].items():
        assert "error" not in v, (name, v)
        assert v["fwd_bwd_s"] > 0 and v["optimizer_s"] > 0 and v["step_s"] >= v["fwd_bwd_s"]
        assert len(v["fwd_bwd_all_s"]) == 2 and v["syncs_per_step"] == 3  # the same syncs for ours and HEAD
        assert v["top_kernels"] and v["top_kernels"][0]["ms"] >= v["top_kernels"][-1]["ms"]
        assert v["sdpa"] == "flash", (name, v["sdpa_ops"])  # CPU's SDPA kernel, ours and the stand-in's alike
    ours, theirs = report["variants"]["plain_model_1"], report["variants"]["head_native"]
    assert (ours["compile_scope"], ours["head_chunks"], ours["diagnostics"]) == ("model", 1, False)
    assert report["variants"]["plain_layer_16"]["diagnostics"] and report["variants"]["trm_holding"]["head_chunks"] == 1
    assert ours["optimizer_host_reads"] == 1 and theirs["optimizer_host_reads"] == 0  # our clip reads the norm
    assert report["head"] == {"dir": fake_head, "commit": "0123abc", "has_fa3": False, "use_fa3": False,
                              "compute_dtype": "torch.float32"}
    from nanochat.model import gpt
    assert hasattr(gpt, "STATE_UPDATES")  # ours is back in place after HEAD's modules ran

    # issue 57's recipes: one call reads all three MFUs and the plan's expected time ratio
    holding, recompute, detached = (report["variants"][n] for n in names[3:])
    for v in (holding, recompute, detached):
        assert v["planned_time"] >= 1
    assert holding["recipe"] == {"sample_n_sup": "lognormal_poisson", "backprop_steps": 4,
                                 "detach_between_steps": True}
    assert detached["recipe"]["backprop_steps"] == 1 and detached["recipe"]["sample_n_sup"] is False
    assert recompute["activation_checkpointing"] and not holding["activation_checkpointing"]
    # the toy's 1 GB holds the largest batch as it is: the plan keeps it, recomputation would cost more
    assert holding["batch"] == recompute["batch"] == gpu_gap.SIZES["toy"].trm_max_batch
    assert holding["planned_other"]["checkpointing"] and holding["planned_other"]["time"] > holding["planned_time"]
    from nanochat.model.gpt import GPT, GPTConfig
    from nanochat.train.flops import estimate_flops
    config = GPTConfig(**gpu_gap.SIZES["toy"].model, **gpu_gap.HOLDING)
    assert holding["flops_per_token"] == estimate_flops(GPT(config), n_sup=config.n_sup_train)
    table = (out / "gap.md").read_text()
    assert all(f"| {name} | " in table for name in names)
    assert "Recompute or accumulate: the recomputing batch 2 took" in table and "the plan expected" in table
    # on a CPU there is no MFU, so the bar is not read; a GPU's report says met or not
    assert "Issue 57's bar" not in table
    report["variants"]["trm_holding"]["mfu"] = 0.47
    assert "trm_holding at 47.0% MFU at the planner's batch 2: met (>= 45%)" in gpu_gap.markdown(report)
    report["variants"]["trm_holding"]["mfu"] = 0.30
    assert ": NOT met (>= 45%)" in gpu_gap.markdown(report)


def test_no_variant_starts_past_the_budget_and_one_that_cannot_run_says_why(tmp_path):
    out = tmp_path / "gap"
    gpu_gap.main(["--device", "cpu", "--size", "toy", "--out", str(out), "--variants", "head_native"])
    report = json.loads((out / "gap.json").read_text())
    assert report["variants"]["head_native"]["error"].startswith("not run: no --nanochat DIR")
    gpu_gap.main(["--device", "cpu", "--size", "toy", "--budget_s", "0", "--out", str(out),
                  "--variants", "plain_layer_16,plain_model_1"])
    report = json.loads((out / "gap.json").read_text())
    assert report["variants"] == {}
    assert report["skipped"] == {name: "past --budget_s=0" for name in ("plain_layer_16", "plain_model_1")}
    assert "| plain_model_1 | skipped: past --budget_s=0 |" in (out / "gap.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--variants", "plain,nope"], "--variants: unknown plain, nope"),
    (["--nanochat", "/nonexistent"], "no nanochat/gpt.py there; bash dev/gpu_carry.sh --model-only"),
    (["--device", "cuda"], "torch sees no CUDA device here"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        gpu_gap.main(["--device", "cpu", "--out", str(tmp_path / "out"), *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not (tmp_path / "out").exists()
