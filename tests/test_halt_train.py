"""scripts.halt_train: a halting head trained afterwards with the model frozen, written as a new tag."""

import math

import pytest
import torch

from nanochat.model.gpt import HALT_BIAS_INIT
from nanochat.model.halting import HALT_MARGIN, frozen_halt_head_loss
from tests.support import helpers
from tests.test_halting import random_model, tokens


def test_the_frozen_loss_reaches_only_the_head_and_counts_the_targets():
    model = random_model()
    idx, targets = tokens(2, 8), tokens(2, 8, seed=2)
    targets[0, :3] = -1  # ignored positions count neither in the BCE nor in the rate
    bce, rate = frozen_halt_head_loss(model, idx, targets)
    bce.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("halt_head"))
    assert model.halt_head.weight.grad.abs().sum() > 0
    with torch.no_grad():
        losses = model(idx, targets, n_sup=model.config.n_sup_inference, loss_reduction="none")  # (N, B, T)
    valid = targets != -1
    expected = ((losses[:-1] - losses[1:] <= HALT_MARGIN) & valid).float().sum() / (valid.sum() * (len(losses) - 1))
    assert 0 < rate < 1 and rate.item() == pytest.approx(expected.item())


def test_training_the_frozen_head_beats_the_blind_guess_on_its_batch():
    """The head's gradient is right: AdamW on one batch of a random model (whose halting targets depend on y) takes
    its BCE from the blind guess's to below it."""
    from scripts.halt_train import blind_bce
    model = random_model()
    model.requires_grad_(False)
    model.halt_head.requires_grad_(True)
    idx, targets = tokens(4, 8), tokens(4, 8, seed=2)
    _, rate = frozen_halt_head_loss(model, idx, targets)
    with torch.no_grad():
        model.halt_head.weight.zero_()
        model.halt_head.bias.fill_(math.log(rate / (1 - rate)))
    start, _ = frozen_halt_head_loss(model, idx, targets)
    assert start.item() == pytest.approx(blind_bce(rate.item()), abs=1e-5)
    optimizer = torch.optim.AdamW(model.halt_head.parameters(), lr=0.05)
    for _ in range(50):
        bce, _ = frozen_halt_head_loss(model, idx, targets)
        bce.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert frozen_halt_head_loss(model, idx, targets)[0] < 0.8 * start


def halt_train(*flags):
    from scripts import halt_train
    return halt_train.main(["--model_tag=halt", "--device_type=cpu", "--device_batch_size=2",
                            "--eval_tokens=256", *flags])


def test_halt_train_writes_a_new_tag_with_a_trained_head_and_the_same_model(trained_tiny, monkeypatch):
    from nanochat.checkpoint.manager import load_model, model_dir
    from scripts import base_loss
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    source_files = helpers.tree(model_dir("halt"))
    result = halt_train("--num_iterations=40", "--lr=0.05", "--out_tag=halt_frozen")
    assert helpers.tree(model_dir("halt")) == source_files  # the source is only read
    assert result["before"] == result["blind"]  # a new head starts at the blind guess
    source, _, _ = load_model("halt", "latest", "cpu")
    trained, _, meta = load_model("halt_frozen", "latest", "cpu")
    assert trained.config.halt_head and meta["halt_train"]["from"] == "halt"
    assert trained.halt_head.bias.item() != HALT_BIAS_INIT and trained.halt_head.weight.abs().sum() > 0
    for name, weight in source.state_dict().items():
        assert torch.equal(trained.state_dict()[name], weight), name
    results = base_loss.main(["--model_tag=halt_frozen", "--device_type=cpu", "--device_batch_size=2",
                              "--split_tokens=128", "--sample_tokens=2", "--halt=head:0.5"])
    assert 1 <= results["val_halting"]["mean_steps"] <= 3


@pytest.mark.parametrize("flags, message", [
    (["--out_tag=halt"], "is the source tag"),
    (["--out_tag=taken"], "already holds a run"),
    (["--lr=0"], "--lr=0.0 must be > 0"),
])
def test_bad_input_is_one_line_and_writes_nothing(trained_tiny, monkeypatch, flags, message):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    if "--out_tag=taken" in flags:
        from scripts import base_train
        base_train.main(helpers.TINY + ["--num_iterations=1", "--eval_every=0", "--model_tag=taken"])
    before = helpers.tree(trained_tiny)
    with pytest.raises(SystemExit) as exit_info:
        halt_train("--num_iterations=1", *flags)
    assert isinstance(exit_info.value.code, str) and message in exit_info.value.code
    assert "\n" not in exit_info.value.code
    assert helpers.tree(trained_tiny) == before


def test_base_train_refuses_to_resume_a_halt_train_tag_in_one_line(trained_tiny, monkeypatch, capsys):
    from scripts import base_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", trained_tiny)
    halt_train("--num_iterations=1", "--out_tag=resumed_halt")
    before = helpers.tree(trained_tiny)
    capsys.readouterr()
    code = helpers.exit_code(base_train.main, *helpers.TINY, "--n_sup_train=3", "--num_iterations=4",
                             "--model_tag=resumed_halt", "--resume")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code not in (0, None) and len(lines) == 1, lines
    assert "written by scripts.halt_train" in lines[0] and "resume 'halt' instead" in lines[0]
    assert helpers.tree(trained_tiny) == before
