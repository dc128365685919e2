"""nanochat/weight_average: the same average as torch's AveragedModel with get_ema_multi_avg_fn, without its syncs."""

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nanochat.train.weight_average import WeightAverage


def test_equals_torchs_ema_over_several_updates():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
    ours, reference = WeightAverage(model, 0.8), AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    for _ in range(4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ours.update_parameters(model)
        reference.update_parameters(model)
    for a, b, w in zip(ours.module.parameters(), reference.module.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, w)


def test_the_first_update_copies_and_a_resumed_average_blends():
    model = torch.nn.Linear(3, 3)
    average = WeightAverage(model, 0.5)
    with torch.no_grad():
        model.weight.fill_(2.0)
    average.update_parameters(model)
    assert torch.equal(average.module.weight, model.weight)
    resumed = WeightAverage(model, 0.5)
    resumed.started = True  # as checkpoint_manager.restore leaves it
    with torch.no_grad():
        resumed.module.weight.fill_(0.0)
    resumed.update_parameters(model)
    assert torch.allclose(resumed.module.weight, torch.full((3, 3), 1.0))
