"""
DistMuon / DistAdamW against their single-process forms. Launched by tests/test_optim.py as

    torchrun --standalone --nproc_per_node=2 tests/support/dist_optim_worker.py OUT_DIR

Every rank builds the same models, computes its own gradient (a different batch / random tensor per rank), and runs
base_train's update (reduce_gradients, the norm summed over ranks, clipped_step) with the distributed optimizers; each
rank saves its final parameters to OUT_DIR/rank{r}.pt. The test runs run(distributed=False) in one process on the
average of all ranks' gradients and compares.
"""

import os
import sys

import torch
import torch.distributed as dist

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.optim import AdamW, DistAdamW, DistMuon, Muon, clipped_step, reduce_gradients, setup_optimizers

WORLD_SIZE = 2
STEPS = 3
GRAD_CLIP = 0.05  # well below every gradient norm here: clipping really happens on every step

# n_layer=3 makes the c_fc and mlp.c_proj shape groups hold 3 matrices each: an odd count on 2 ranks
GPT_CONFIG = dict(sequence_len=8, vocab_size=48, n_layer=3, n_head=2, n_kv_head=1, n_embd=16, n_loops=1,
                  n_sup_train=2)
# numels 7, 15 and 1 don't divide the world size (1 is even smaller than it); (6, 10) x 3 is another odd group
TOY_MUON_SHAPES = [(6, 10), (9, 5), (6, 10), (4, 4), (6, 10), (4, 4)]
TOY_ADAM_SHAPES = [(7,), (3, 5), (1,)]


def build_gpt():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**GPT_CONFIG))
    model.init_weights()
    with torch.no_grad():  # randomise the zero-initialised projections so every matrix gets a gradient at once
        for p in model.parameters():
            if not p.any():
                p.normal_(std=0.2)
    return model


def gpt_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, GPT_CONFIG["vocab_size"], (2, 2, GPT_CONFIG["sequence_len"]), generator=g).unbind(0)


def build_toy():
    g = torch.Generator().manual_seed(1)
    muon = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in TOY_MUON_SHAPES]
    adam = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in TOY_ADAM_SHAPES]
    return muon, adam


def toy_grads(params, rank, step):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return [torch.randn(p.shape, generator=g) for p in params]


def update(optimizers, distributed):
    """base_train's update: each rank's share of the squared norm, summed over ranks, then clipped_step; the norm."""
    sq_grad_norm = reduce_gradients(optimizers)
    if distributed:
        dist.all_reduce(sq_grad_norm)
    grad_norm = sq_grad_norm.sqrt().item()
    clipped_step(optimizers, grad_norm, GRAD_CLIP)
    return grad_norm


def run(distributed, rank=0):
    """Train both models for STEPS steps. distributed: this rank's gradients and the Dist optimizers; otherwise the
    average of all WORLD_SIZE ranks' gradients and the single-process optimizers."""
    ranks = [rank] if distributed else range(WORLD_SIZE)
    model = build_gpt()
    gpt_opts = setup_optimizers(model, weight_decay=0.1)
    expected = (DistAdamW, DistMuon) if distributed else (AdamW, Muon)
    assert tuple(map(type, gpt_opts)) == expected, gpt_opts
    muon_params, adam_params = build_toy()
    toy_opts = [(DistAdamW if distributed else AdamW)([dict(params=adam_params, lr=0.01)], betas=(0.8, 0.95),
                                                        weight_decay=0.1),
                (DistMuon if distributed else Muon)(muon_params, lr=0.02, momentum=0.95, weight_decay=0.1)]
    norms = []
    for step in range(STEPS):
        for r in ranks:
            total, _ = model(*gpt_batch(r, step))
            (total / len(ranks)).backward()
        toy = muon_params + adam_params
        for p in toy:
            p.grad = torch.zeros_like(p)
        for r in ranks:
            for p, grad in zip(toy, toy_grads(toy, r, step)):
                p.grad += grad / len(ranks)
        norms.append((update(gpt_opts, distributed), update(toy_opts, distributed)))
        model.zero_grad(set_to_none=True)
    return {"gpt": {k: v.clone() for k, v in model.state_dict().items()},
            "toy": [p.detach().clone() for p in muon_params + adam_params], "norms": norms}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == WORLD_SIZE
    torch.save(run(distributed=True, rank=rank), os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.destroy_process_group()
