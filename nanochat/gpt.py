"""
The GPT with TRM recursive refinement and deep supervision.

The backbone is nanochat's GPT: token embedding then a parameter-free RMSNorm, rotary embeddings (base 10000,
applied before QK-norm), grouped-query attention, no biases, untied embedding and lm_head, logits soft-capped at 15,
zero-initialised output projections.

The recursion (TRM). The input x = norm(wte(idx)) is fixed, the answer y starts as x, the latent z starts at zero.
Each layer l wraps one ordinary pre-norm block B_l; D_l(u) = B_l(u) - u is its residual branch (attention + MLP).
Visiting layer l does n_loops latent updates z <- z + D_l(x + y + z), then one answer update y <- y + D_l(y + z).
A sweep visits layers 0 .. n_layer-1. A supervision step is T_recursion sweeps, the first T_recursion-1 without
gradient (as the TRM paper runs whole recursion cycles without gradient), then logits_s = softcap(lm_head(norm(y))).
With T_recursion > 1 the gradient into the previous supervision step is therefore cut as well (the no-grad sweeps
consume the carried y and z), which is the paper's behaviour. n_loops = 0 is a plain block y <- B_l(y), no z.
"""

import importlib
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ACTIVATIONS = ("relu_squared", "swiglu", "geglu")

# (supervision_weight_base, improvement_reward_scale) per preset; the guides' Phase 1 is aggressive, Phase 2 extreme.
REFINEMENT_PRESETS = {
    "moderate": (3.0, 0.5),
    "aggressive": (5.0, 1.0),
    "extreme": (10.0, 2.0),
}


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 65536
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    activation_fn: str = "relu_squared"
    n_loops: int = 2  # latent updates per layer visit; 0 = plain GPT block
    T_recursion: int = 1  # sweeps per supervision step; all but the last run without gradient
    n_sup_train: int = 4  # supervision steps during training
    # None = same as n_sup_train: evaluating at a step that training barely weighted (or never saw) is a trap.
    n_sup_inference: int | None = None
    detach_between_steps: bool = False  # True: carry y, z detached between steps (TRM paper); see forward_backward
    activation_checkpointing: bool = False  # recompute each layer visit in backward instead of storing it
    # The guides tell users to edit these two lines between phases (aggressive -> extreme): keep them plain literals.
    supervision_weight_base: float = 5.0
    improvement_reward_scale: float = 1.0

    def __post_init__(self):
        if self.n_sup_inference is None:
            self.n_sup_inference = self.n_sup_train
        for name, minimum in [("sequence_len", 1), ("vocab_size", 1), ("n_layer", 1), ("n_head", 1),
                              ("n_kv_head", 1), ("n_embd", 1), ("n_loops", 0), ("T_recursion", 1),
                              ("n_sup_train", 1), ("n_sup_inference", 1)]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"GPTConfig.{name}={value!r}: must be an integer >= {minimum}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"pick n_head so that n_embd/n_head is the head dimension")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"GPTConfig: head dimension n_embd/n_head={self.n_embd // self.n_head} must be even "
                             f"for rotary embeddings")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head} "
                             f"(each key/value head serves n_head/n_kv_head query heads)")
        if self.n_loops == 0 and self.T_recursion > 1:
            raise ValueError(f"GPTConfig.T_recursion={self.T_recursion} needs n_loops >= 1: a plain block never re-reads "
                             f"the input, so the no-gradient sweeps would cut the embedding off from the loss")
        if self.activation_fn not in ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation_fn={self.activation_fn!r} is unknown; choose one of {ACTIVATIONS}")
        if not self.supervision_weight_base > 0:
            raise ValueError(f"GPTConfig.supervision_weight_base={self.supervision_weight_base} must be > 0 "
                             f"(step weights are base**s)")
        if not self.improvement_reward_scale >= 0:
            raise ValueError(f"GPTConfig.improvement_reward_scale={self.improvement_reward_scale} must be >= 0 "
                             f"(a negative scale would reward making later steps worse)")

    @classmethod
    def with_refinement_preset(cls, name, **overrides):
        """A config whose (supervision_weight_base, improvement_reward_scale) come from a preset; overrides win."""
        if name not in REFINEMENT_PRESETS:
            raise ValueError(f"unknown refinement preset {name!r}; valid presets: {', '.join(REFINEMENT_PRESETS)}")
        base, scale = REFINEMENT_PRESETS[name]
        return cls(**{"supervision_weight_base": base, "improvement_reward_scale": scale, **overrides})

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes):
        return replace(self, **changes)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary_emb(x, cos, sin):
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)


def supervision_weights(n_sup, base):
    """w_s = base**s / sum_j base**j: later (better) steps weigh more."""
    powers = [base ** s for s in range(n_sup)]
    return [p / sum(powers) for p in powers]


def deep_supervision_loss(step_losses, base, scale):
    """total = sum_s w_s loss_s - scale * sum_{s>=1} (sg(loss_{s-1}) - loss_s) / sg(loss_{s-1}).

    The stop-gradient means a step can never earn reward by making the previous draft worse. Because of it the
    reward acts as an extra weight scale/loss_{s-1} on each later step's loss, which at typical losses (~3-10)
    dominates the base**s weights.
    """
    weights = supervision_weights(len(step_losses), base)
    total = sum(w * loss for w, loss in zip(weights, step_losses))
    for prev, cur in zip(step_losses[:-1], step_losses[1:]):
        prev = prev.detach()
        total = total - scale * (prev - cur) / prev
    return total


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos_sin, kv_cache=None, slot=None):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos_sin
        q, k = norm(apply_rotary_emb(q, cos, sin)), norm(apply_rotary_emb(k, cos, sin))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        else:
            # every attention application of the recursion has its own slot of keys and values
            y = kv_cache.attend(slot, q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation_fn = config.activation_fn
        hidden = 4 * config.n_embd
        if config.activation_fn != "relu_squared":
            hidden = 64 * math.ceil(hidden * 2 / 3 / 64)  # gated: 2/3 width keeps parameters ~ equal to relu^2
        self.gated = config.activation_fn != "relu_squared"
        self.c_fc = nn.Linear(config.n_embd, hidden * (2 if self.gated else 1), bias=False)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        h = self.c_fc(x)
        if self.activation_fn == "relu_squared":
            h = F.relu(h).square()
        else:
            gate, up = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.activation_fn == "swiglu" else F.gelu(gate)) * up
        return self.c_proj(h)


class Block(nn.Module):
    """One ordinary pre-norm transformer block B(u) = u + D(u)."""

    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)

    def forward(self, u, cos_sin, kv_cache=None, slot=None):
        u = u + self.attn(norm(u), cos_sin, kv_cache, slot)
        return u + self.mlp(norm(u))

    def delta(self, u, cos_sin, kv_cache=None, slot=None):
        """D(u) = B(u) - u, the block's residual branches, computed without the cancellation of B(u) - u."""
        a = self.attn(norm(u), cos_sin, kv_cache, slot)
        return a + self.mlp(norm(u + a))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # rotary tables for 10x the context, so cached generation can run past sequence_len
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary(self.rotary_seq_len, config.n_embd // config.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    # ---------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_weights(self):
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                nn.init.normal_(module.weight, mean=0.0, std=1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in)))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=1.0)
        # zero the output projections: every block starts as the identity, and the head predicts uniform
        nn.init.zeros_(self.lm_head.weight)
        for block in self.transformer.h:
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        cos, sin = self._precompute_rotary(self.rotary_seq_len, self.config.n_embd // self.config.n_head)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _precompute_rotary(self, seq_len, head_dim, base=10000):
        device = self.transformer.wte.weight.device
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    # ---------------------------------------------------------------- the recursion
    def num_attention_slots(self, n_sup):
        """How many attention applications one forward makes: the KV cache needs one slot for each."""
        c = self.config
        return n_sup * c.T_recursion * c.n_layer * (c.n_loops + 1)

    def _visit_layer(self, layer, x, y, z, cos_sin, kv_cache, slot):
        """One layer visit: n_loops latent updates then one answer update (or a plain block when n_loops=0)."""
        block = self.transformer.h[layer]
        if self.config.n_loops == 0:
            return block(y, cos_sin, kv_cache, slot), z
        for i in range(self.config.n_loops):
            z = z + block.delta(x + y + z, cos_sin, kv_cache, slot + i)
        y = y + block.delta(y + z, cos_sin, kv_cache, slot + self.config.n_loops)
        return y, z

    def _sweep(self, x, y, z, cos_sin, kv_cache, slot):
        for layer in range(self.config.n_layer):
            s = slot + layer * (self.config.n_loops + 1)
            if self.config.activation_checkpointing and torch.is_grad_enabled() and kv_cache is None:
                y, z = checkpoint(self._visit_layer, layer, x, y, z, cos_sin, None, s, use_reentrant=False)
            else:
                y, z = self._visit_layer(layer, x, y, z, cos_sin, kv_cache, s)
        return y, z

    def refine(self, idx, n_sup, kv_cache=None, x=None):
        """Yield the answer state y after each of n_sup supervision steps (x: the embedded input, if precomputed)."""
        c = self.config
        B, T = idx.shape
        T0 = kv_cache.pos if kv_cache is not None else 0
        if T0 + T > self.cos.size(1):
            raise ValueError(f"sequence of {T0 + T} tokens exceeds the rotary table ({self.cos.size(1)})")
        cos_sin = self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]
        x = norm(self.transformer.wte(idx)) if x is None else x
        y = x
        z = torch.zeros_like(x) if c.n_loops else None
        slots_per_sweep = c.n_layer * (c.n_loops + 1)  # a plain block (n_loops=0) attends once
        slot = 0
        for _ in range(n_sup):
            for sweep in range(c.T_recursion):
                with torch.set_grad_enabled(torch.is_grad_enabled() and sweep == c.T_recursion - 1):
                    y, z = self._sweep(x, y, z, cos_sin, kv_cache, slot)
                slot += slots_per_sweep
            yield y
            if c.detach_between_steps:
                y, z = y.detach(), (z.detach() if z is not None else None)

    def head(self, y):
        softcap = 15.0
        logits = self.lm_head(norm(y)).float()
        return softcap * torch.tanh(logits / softcap)

    def forward(self, idx, targets=None, n_sup=None, kv_cache=None, loss_reduction="mean"):
        """
        model(idx) -> logits (B, T, V) of the last of n_sup (default n_sup_inference) steps.
        model(idx, targets) -> (total, aux): the deep-supervision loss over n_sup (default n_sup_train) steps, and
            aux = {"step_losses": (N,) detached, in order, "refinement": (loss_0 - loss_last) / loss_0}.
        model(idx, targets, loss_reduction="none") -> per-token losses of every step, shape (N, B, T).
        """
        c = self.config
        if targets is None:
            n_sup = n_sup or c.n_sup_inference
            for y in self.refine(idx, n_sup, kv_cache):
                pass
            if kv_cache is not None:
                kv_cache.advance(idx.size(1))
            return self.head(y)
        n_sup = n_sup or c.n_sup_train
        step_losses = []
        for y in self.refine(idx, n_sup):
            logits = self.head(y)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                                   reduction=loss_reduction)
            step_losses.append(loss.view(targets.shape) if loss_reduction == "none" else loss)
        if loss_reduction == "none":
            return torch.stack(step_losses)
        total = deep_supervision_loss(step_losses, c.supervision_weight_base, c.improvement_reward_scale)
        losses = torch.stack([l.detach() for l in step_losses])
        aux = {"step_losses": losses, "refinement": (losses[0] - losses[-1]) / losses[0]}
        return total, aux

    def forward_backward(self, idx, targets, loss_scale=1.0):
        """A training micro-step: the loss of model(idx, targets), backpropagated (scaled by loss_scale).

        With detach_between_steps each supervision step is backpropagated as soon as its loss is known, so only one
        step's activations and logits are alive at a time: memory stops growing with the number of steps. The
        gradients equal those of total.backward(): d total / d loss_s = w_s + c / sg(loss_{s-1}) for s >= 1.
        Returns (total, aux) like model(idx, targets), detached.
        """
        c = self.config
        if not c.detach_between_steps:
            total, aux = self(idx, targets)
            (total * loss_scale).backward()
            return total.detach(), aux
        x = norm(self.transformer.wte(idx))
        x_leaf = x.detach().requires_grad_()  # every step reads x: collect its gradient, backprop into wte once
        weights = supervision_weights(c.n_sup_train, c.supervision_weight_base)
        step_losses = []
        for s, y in enumerate(self.refine(idx, c.n_sup_train, x=x_leaf)):
            logits = self.head(y)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            weight = weights[s] + (c.improvement_reward_scale / step_losses[-1] if s else 0.0)
            (loss * weight * loss_scale).backward()
            step_losses.append(loss.detach())
        x.backward(x_leaf.grad)
        total = deep_supervision_loss(step_losses, c.supervision_weight_base, c.improvement_reward_scale)
        losses = torch.stack(step_losses)
        return total, {"step_losses": losses, "refinement": (losses[0] - losses[-1]) / losses[0]}

    def step_logits(self, idx, n_sup=None):
        """Logits of every supervision step, (N, B, T, V): to watch a draft become the final answer."""
        return torch.stack([self.head(y) for y in self.refine(idx, n_sup or self.config.n_sup_inference)])

    # ---------------------------------------------------------------- accounting
    def block_params(self):
        return sum(p.numel() for p in self.transformer.h[0].parameters())

    def estimate_flops(self, n_sup=None, backward=True):
        """FLOPs per token of one training step (backward=True) or one inference forward (backward=False).

        Counts every block application (with and without gradient, every loop, sweep and supervision step) at
        2 FLOPs per weight forward and 4 backward, plus attention (nanochat's 12*h*q*t per layer, full context),
        plus the lm_head of every supervision step. Activation-checkpoint recomputation is not counted: MFU
        reports model FLOPs, so turning recomputation on shows up honestly as lower MFU.
        """
        c = self.config
        n_sup = n_sup or (c.n_sup_train if backward else c.n_sup_inference)
        head_dim = c.n_embd // c.n_head
        applications = c.n_layer * (c.n_loops + 1)
        forward_app = 2 * self.block_params() + 4 * c.n_head * head_dim * c.sequence_len
        grad_mult = 3 if backward else 1
        grad_sweeps, nograd_sweeps = (1, c.T_recursion - 1)
        per_step = applications * forward_app * (grad_mult * grad_sweeps + nograd_sweeps)
        per_step += grad_mult * 2 * self.lm_head.weight.numel()
        return n_sup * per_step

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    # ---------------------------------------------------------------- optimizers
    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0):
        """Muon for the transformer matrices, AdamW for embedding and lm_head (distributed variants under DDP)."""
        import torch.distributed as dist
        # by name: transformers' remote-code loader would make users of an exported gpt.py install `nanochat`
        adamw, muon = importlib.import_module("nanochat.adamw"), importlib.import_module("nanochat.muon")
        AdamW, DistAdamW, Muon, DistMuon = adamw.AdamW, adamw.DistAdamW, muon.Muon, muon.DistMuon

        ddp = dist.is_available() and dist.is_initialized()
        matrix_params = list(self.transformer.h.parameters())
        dmodel_lr_scale = (self.config.n_embd / 768) ** -0.5  # AdamW lrs were tuned at width 768
        adam_groups = [
            dict(params=list(self.lm_head.parameters()), lr=unembedding_lr * dmodel_lr_scale),
            dict(params=list(self.transformer.wte.parameters()), lr=embedding_lr * dmodel_lr_scale),
        ]
        adam_cls, muon_cls = (DistAdamW, DistMuon) if ddp else (AdamW, Muon)
        adamw = adam_cls(adam_groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=weight_decay)
        muon = muon_cls(matrix_params, lr=matrix_lr, momentum=0.95, weight_decay=weight_decay)
        optimizers = [adamw, muon]
        for opt in optimizers:
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        return optimizers
