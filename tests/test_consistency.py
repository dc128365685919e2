"""dev/consistency.py: the research lever's term is what its docstring says, in the training path's gradients, and
leaves GPT as it was after its block."""

import torch
import torch.nn.functional as F

from dev.consistency import installed
from nanochat.model.gpt import GPT
from nanochat.model.supervision import deep_supervision_loss
from tests.support import helpers

WEIGHT = 0.7


def by_hand_total(model, idx, targets, n_sup):
    """The deep-supervision total with the term, from model.refine and plain cross-entropy: no dev code."""
    c, losses, previous = model.config, [], None
    for s, (y, _) in enumerate(model.refine(idx, n_sup)):
        loss = F.cross_entropy(model.head(y).flatten(0, 1), targets.flatten())
        if s:  # the first step's update, from the embedding, is free
            moved = (y - previous).square().sum(-1) / previous.square().sum(-1)
            loss = loss + WEIGHT * moved.mean()
        losses.append(loss)
        previous = y.detach()
    return deep_supervision_loss(losses, c.supervision_weight_base, c.improvement_reward_scale)


def test_the_term_is_in_the_training_gradients_and_gpt_is_restored_after():
    config = helpers.tiny_config(n_loops=2, n_sup_train=3, backprop_steps=4)
    model = helpers.random_model(config)
    twin = GPT(config)
    twin.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(3)
    idx, targets = (torch.randint(0, config.vocab_size, (2, config.sequence_len), generator=g) for _ in range(2))
    original = (GPT.forward_backward, GPT.step_loss)

    by_hand_total(model, idx, targets, 4).backward()
    with installed(WEIGHT):
        total, _ = twin.forward_backward(idx, targets, n_sup=4)
    assert (GPT.forward_backward, GPT.step_loss) == original
    torch.testing.assert_close(total, by_hand_total(model, idx, targets, 4).detach())
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)

    # without the term the same training step differs: the check above could fail
    twin.zero_grad(set_to_none=True)
    plain, _ = twin.forward_backward(idx, targets, n_sup=4)
    assert plain < total - 1e-4
    with installed(0.0):
        assert (GPT.forward_backward, GPT.step_loss) == original  # weight 0 installs nothing
