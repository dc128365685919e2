"""
The GPT with TRM recursive refinement and deep supervision.

The backbone is nanochat's GPT: token embedding then a parameter-free RMSNorm, rotary embeddings (base 10000,
applied before QK-norm), grouped-query attention, no biases, untied embedding and lm_head, logits soft-capped at 15,
zero-initialised output projections.

The recursion (TRM). The input x = norm(wte(idx)) is fixed, the answer y starts as x, the latent z starts at zero.
Each layer l wraps one ordinary pre-norm block B_l; D_l(u) = B_l(u) - u is its residual branch (attention + MLP).
Visiting layer l does n_loops latent updates on u = x + y + z, then one answer update on u = y + z; the state update
(GPTConfig.state_update) writes D_l(u) into z or y: by default TRM's z <- norm(u + D_l(u)), originally z <- z + D_l(u).
A sweep visits layers 0 .. n_layer-1. A supervision step is T_recursion sweeps, the first T_recursion-1 without
gradient (as the TRM paper runs whole recursion cycles without gradient), then logits_s = softcap(lm_head(norm(y))).
With T_recursion > 1 the gradient into the previous supervision step is therefore cut as well (the no-grad sweeps
consume the carried y and z), which is the paper's behaviour. n_loops = 0 is a plain block y <- B_l(y), no z.
"""

import functools
import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .halting import halt_head_loss
from .supervision import (
    SOFTCAP,
    ChunkedHeadLoss,
    chunked_token_losses,
    consistency_term,
    deep_supervision_loss,
    loss_aux,
    normed_head_chunk_loss_and_grads,
    reward_weight,
    rows_per_chunk,
    state_diagnostics,
    supervision_weights,
)

ACTIVATIONS = ("relu_squared", "swiglu", "geglu")

# (supervision_weight_base, improvement_reward_scale) per preset; the guides' Phase 1 is aggressive, Phase 2 extreme;
# uniform is TRM's own deep supervision: every step's loss weighs the same, no improvement reward.
REFINEMENT_PRESETS = {
    "uniform": (1.0, 0.0),
    "moderate": (3.0, 0.5),
    "aggressive": (5.0, 1.0),
    "extreme": (10.0, 2.0),
}


# GPTConfig.sample_n_sup's drawn step counts by name (nanochat/train/depth.py draws them: training policy, not model)
N_SUP_SAMPLERS = ("uniform", "lognormal_poisson")

# Config fields added after checkpoints existed, and the behaviour those checkpoints were trained with.
FIELDS_BEFORE_THEY_EXISTED = {"state_update": "residual", "sample_n_sup": False, "state_dtype": "float32",
                              "backprop_steps": 1, "consistency_weight": 0.0}
STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    state_update: str = "trm"  # how a layer visit writes into y and z: see STATE_UPDATES (n_loops >= 1 only)
    # True or a name of N_SUP_SAMPLERS: each optimizer step trains a random number of supervision steps, mean about
    # n_sup_train (the same compute): every step must be a good answer, and stay one when run longer (Huginn).
    # True = "uniform" on 1 .. 2*n_sup_train-1; "lognormal_poisson" = Huginn's and looped_nanochat's heavier tail.
    # The default since issue 57: with backprop_steps=4 (and base_train's step-count curriculum) the answer holds past
    # the trained steps on lookups and on text, and text trains to a lower bpb (dev/LOG.md). False: n_sup_train always.
    sample_n_sup: bool | str = "lognormal_poisson"
    # the recursion state x, y, z's dtype: "bfloat16" keeps it in bf16 under autocast (the head and losses stay float32)
    state_dtype: str = "float32"
    detach_between_steps: bool = True  # carry y, z detached between steps (TRM paper); see forward_backward
    # with detach_between_steps: detach only after every k-th step, so gradients run back through up to k steps
    # (truncated backpropagation; 1 = the TRM's one-step gradient, n_sup_train = full; 4 since issue 57)
    backprop_steps: int = 4
    activation_checkpointing: bool = False  # recompute each layer visit in backward instead of storing it
    # a learned halting head sigmoid(Linear(norm(y))), trained alongside on a detached y (see halt_head_loss)
    halt_head: bool = False
    # plain blocks that run once before the recursion (on the embedding, giving x) and after it (on the answer y,
    # before the head: at every supervision step whose logits are asked for); middle looping (Saunshi et al.)
    n_prelude: int = 0
    n_coda: int = 0
    # The guides tell users to edit these two lines between phases (aggressive -> extreme): keep them plain literals.
    supervision_weight_base: float = 5.0
    improvement_reward_scale: float = 1.0
    # each supervision step after the first also pays this x its relative move of the answer y (consistency_term), so
    # the steps past N settle where the loss is lowest instead of drifting past it (issue 57, dev/LOG.md); 0 = off
    consistency_weight: float = 0.0

    def __post_init__(self):
        if self.n_sup_inference is None:
            self.n_sup_inference = self.n_sup_train
        for name, minimum in [("sequence_len", 1), ("vocab_size", 1), ("n_layer", 1), ("n_head", 1),
                              ("n_kv_head", 1), ("n_embd", 1), ("n_loops", 0), ("T_recursion", 1),
                              ("n_sup_train", 1), ("n_sup_inference", 1), ("n_prelude", 0), ("n_coda", 0),
                              ("backprop_steps", 1)]:
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
            raise ValueError(f"GPTConfig.T_recursion={self.T_recursion} needs n_loops >= 1: a plain block never "
                             f"re-reads the input, so the no-gradient sweeps would cut the embedding off from the loss")
        if not isinstance(self.halt_head, bool):
            raise ValueError(f"GPTConfig.halt_head={self.halt_head!r}: must be True or False")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"GPTConfig.state_dtype={self.state_dtype!r} is unknown; choose one of "
                             f"{list(STATE_DTYPES)}")
        if self.sample_n_sup not in (False, True, *N_SUP_SAMPLERS):
            raise ValueError(f"GPTConfig.sample_n_sup={self.sample_n_sup!r}: True, False or one of "
                             f"{list(N_SUP_SAMPLERS)}")
        if self.state_update not in STATE_UPDATES:
            raise ValueError(f"GPTConfig.state_update={self.state_update!r} is unknown; choose one of "
                             f"{tuple(STATE_UPDATES)}")
        if self.activation_fn not in ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation_fn={self.activation_fn!r} is unknown; choose one of {ACTIVATIONS}")
        if not self.supervision_weight_base > 0:
            raise ValueError(f"GPTConfig.supervision_weight_base={self.supervision_weight_base} must be > 0 "
                             f"(step weights are base**s)")
        if not self.improvement_reward_scale >= 0:
            raise ValueError(f"GPTConfig.improvement_reward_scale={self.improvement_reward_scale} must be >= 0 "
                             f"(a negative scale would reward making later steps worse)")
        if not self.consistency_weight >= 0:
            raise ValueError(f"GPTConfig.consistency_weight={self.consistency_weight} must be >= 0 "
                             f"(a negative weight would reward moving the answer)")

    @classmethod
    def with_refinement_preset(cls, name, **overrides):
        """A config whose (supervision_weight_base, improvement_reward_scale) come from a preset; overrides win."""
        if name not in REFINEMENT_PRESETS:
            raise ValueError(f"unknown refinement preset {name!r}; valid presets: {', '.join(REFINEMENT_PRESETS)}")
        base, scale = REFINEMENT_PRESETS[name]
        return cls(**{"supervision_weight_base": base, "improvement_reward_scale": scale, **overrides})

    @classmethod
    def from_dict(cls, saved):
        """The config of a checkpoint's meta: a field the checkpoint predates takes the value its model was trained
        with, so old checkpoints keep loading as the model they are."""
        return cls(**{**FIELDS_BEFORE_THEY_EXISTED, **saved})

    def to_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def replace(self, **changes):
        return replace(self, **changes)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


# ---------------------------------------------------------------------------------------------------- state updates
# How a layer visit writes the block's update D = D_l(u), computed on the block's input u, into a recursive state
# (the latent z, with u = x + y + z, or the answer y, with u = y + z). `retain` is the layer's learned per-channel
# decay of that state, used by "decay" only.

def residual_update(state, u, delta, retain):
    """state + D: an unbounded sum (the original recursion; kept to reproduce old runs)."""
    return state + delta


def postnorm_update(state, u, delta, retain):
    """norm(state + D): the state stays at RMS 1, so the input x never fades against it."""
    return norm(state + delta)


def trm_update(state, u, delta, retain):
    """norm(u + D): TRM's post-norm net, z <- net(x + y + z), y <- net(y + z); the state is replaced, not summed."""
    return norm(u + delta)


def decay_update(state, u, delta, retain):
    """a * state + D with a = sigmoid(retain) in (0, 1) per channel: a contraction (Parcae), bounded by
    |D| / (1 - a)."""
    return torch.sigmoid(retain) * state + delta


def stream_step_end(y, z):
    """Renormalise the carried state at the end of a supervision step: within a step "stream" is a deep
    transformer's residual stream (state + D, nothing diluted), across steps it stays bounded at RMS 1."""
    return norm(y), norm(z)


STATE_UPDATES = {"residual": residual_update, "postnorm": postnorm_update, "trm": trm_update, "decay": decay_update,
                 "stream": residual_update}
STEP_ENDS = {"stream": stream_step_end}  # what a state update does to y and z between supervision steps, if anything
DECAY_INIT_LOGIT = 2.0  # sigmoid(2) = 0.88: close to the residual sum at first, still a contraction


def apply_rotary_emb(x, cos, sin):
    # rotate in x's dtype: float32 tables would promote autocast's bf16 q and k to float32 (v stays bf16)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)


def backward(tensors, grads=None):
    """torch.autograd.backward outside any autocast region: forward_backward interleaves forward and backward, and
    backward must run in the dtypes autocast chose in forward, not be autocast again."""
    with torch.autocast(tensors[0].device.type, enabled=False):
        torch.autograd.backward(tensors, grads)


HALT_BIAS_INIT = -5.0  # sigmoid(-5) = 0.007: the halting head starts never halting, so every step trains first (TRM)
HALT_LOSS_WEIGHT = 0.1  # the head's BCE in forward_backward; it reads a detached y, so this scales only its own grads


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
        # CUDA's autocast runs rms_norm in float32: back to v's (the compute) dtype, or the KV cache keeps float32 keys
        q, k = q.to(v.dtype), k.to(v.dtype)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_head != self.n_head)
        else:
            # every attention application of the recursion has its own slot of keys and values
            y = kv_cache.attend(slot, q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


def mlp_hidden(config):
    """The MLP's hidden width: 4 * n_embd for relu^2; gated activations 2/3 of that (parameters ~ equal to relu^2),
    rounded up to a multiple of 64."""
    hidden = 4 * config.n_embd
    return hidden if config.activation_fn == "relu_squared" else 64 * math.ceil(hidden * 2 / 3 / 64)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.activation_fn = config.activation_fn
        hidden = mlp_hidden(config)
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

    def __init__(self, config, recursive=True):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = MLP(config)
        if recursive and config.n_loops and config.state_update == "decay":  # per-channel decay logits of z and of y
            self.retain_z = nn.Parameter(torch.empty(config.n_embd))
            self.retain_y = nn.Parameter(torch.empty(config.n_embd))

    def forward(self, u, cos_sin, kv_cache=None, slot=None):
        u = u + self.attn(norm(u), cos_sin, kv_cache, slot)
        return u + self.mlp(norm(u))

    def delta(self, u, cos_sin, kv_cache=None, slot=None):
        """D(u) = B(u) - u, the block's residual branches, computed without the cancellation of B(u) - u."""
        a = self.attn(norm(u), cos_sin, kv_cache, slot)
        return a + self.mlp(norm(u + a))

    def visit(self, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0, compiled=None):
        """One layer visit through this block: visit_layer, or `compiled`, its torch.compile twin (no cache, and no
        slot, whose int would be a compile guard). FSDP registers it as the block's forward method, so
        a visit's n_loops+1 calls share one gather."""
        if compiled is not None:
            return compiled(self, x, y, z, cos_sin, n_loops, update)
        return visit_layer(self, x, y, z, cos_sin, n_loops, update, kv_cache, slot)


@functools.cache
def state_update_in(name, state_dtype):
    """STATE_UPDATES[name], its result cast to state_dtype (GPTConfig.state_dtype); one function per pair, so a
    compiled layer visit does not recompile."""
    update, dtype = STATE_UPDATES[name], STATE_DTYPES[state_dtype]
    if dtype == torch.float32:
        return update  # today's: the float32 state promotes every update's result
    return lambda state, u, delta, retain: update(state, u, delta, retain).to(dtype)


def sweep_layers(blocks, x, y, z, cos_sin, n_loops, update):
    """One sweep without a cache: every layer visit in order (train/compile.py's scope "model" compiles it whole)."""
    for block in blocks:
        y, z = visit_layer(block, x, y, z, cos_sin, n_loops, update)
    return y, z


def embed_tokens(weight, idx):
    """x = norm(wte(idx)) without prelude or cache (train/compile.py's scope "model" compiles it, with its backward)."""
    return norm(F.embedding(idx, weight))


def visit_layer(block, x, y, z, cos_sin, n_loops, update, kv_cache=None, slot=0):
    """One layer visit: n_loops latent updates then one answer update, each through `update` (a plain block when
    n_loops=0, exactly nanochat's)."""
    if n_loops == 0:
        return block(y, cos_sin, kv_cache, slot), z
    for i in range(n_loops):
        u = x + y + z
        z = update(z, u, block.delta(u, cos_sin, kv_cache, slot + i), getattr(block, "retain_z", None))
    u = y + z
    y = update(y, u, block.delta(u, cos_sin, kv_cache, slot + n_loops), getattr(block, "retain_y", None))
    return y, z


class GPT(nn.Module):
    # the training head's chunks per micro-batch (None: HEAD_CHUNK_ELEMENTS logits a chunk); a run sets the plan's
    head_chunks = None

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd),
            "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
        })
        for name, count in (("prelude", config.n_prelude), ("coda", config.n_coda)):
            if count:  # only when present: a model without them keeps its state dict's keys
                self.transformer[name] = nn.ModuleList([Block(config, recursive=False) for _ in range(count)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.halt_head:
            self.halt_head = nn.Linear(config.n_embd, 1)
        # rotary tables for 10x the context, so cached generation can run past sequence_len
        self.rotary_seq_len = config.sequence_len * 10
        cos, sin = self._precompute_rotary(self.rotary_seq_len, config.n_embd // config.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    # ---------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_weights(self, write=None):
        """Draw every weight from torch's RNG, module by module. write(weight, draw) puts draw's values (draw fills a
        tensor of weight's shape in place) into the weight: by default draw(weight) itself; sharded, write_rows
        (nanochat/train/sharding.py) draws the whole weight on the CPU and keeps this rank's rows, so a sharded model
        gets the same numbers as the unsharded one from the same seed."""
        write = write or (lambda weight, draw: draw(weight))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                std = 1.0 / math.sqrt(fan_in) * min(1.0, math.sqrt(fan_out / fan_in))
                write(module.weight, functools.partial(nn.init.normal_, mean=0.0, std=std))
            elif isinstance(module, nn.Embedding):
                write(module.weight, functools.partial(nn.init.normal_, mean=0.0, std=1.0))
        # zero the output projections: every block starts as the identity, and the head predicts uniform
        nn.init.zeros_(self.lm_head.weight)
        for block in self.blocks():
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if hasattr(block, "retain_y"):
                nn.init.constant_(block.retain_z, DECAY_INIT_LOGIT)
                nn.init.constant_(block.retain_y, DECAY_INIT_LOGIT)
        if self.config.halt_head:  # never halting at first: a zero weight leaves the bias alone
            nn.init.zeros_(self.halt_head.weight)
            nn.init.constant_(self.halt_head.bias, HALT_BIAS_INIT)
        cos, sin = self._precompute_rotary(self.rotary_seq_len, self.config.n_embd // self.config.n_head)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _precompute_rotary(self, seq_len, head_dim, base=10000):
        device = self.transformer.wte.weight.device
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def blocks(self):
        """Every Block: the recursion's, then the prelude's and the coda's."""
        return [block for name, blocks in self.transformer.items() if name != "wte" for block in blocks]

    # ---------------------------------------------------------------- the recursion
    def num_attention_slots(self, n_sup):
        """How many attention applications one forward makes: the KV cache needs one slot for each. Slots: the
        prelude's, then the recursion's, step by step, then the coda's."""
        return self.config.n_prelude + n_sup * self.slots_per_step() + self.config.n_coda

    def slots_per_step(self):
        c = self.config
        return c.T_recursion * c.n_layer * (c.n_loops + 1)

    def rotary(self, T, kv_cache=None):
        """(cos, sin) at this forward's T positions, which follow the tokens the cache holds (per row if its pos is a
        tensor; the engine keeps those within the table)."""
        T0 = kv_cache.pos if kv_cache is not None else 0
        if torch.is_tensor(T0):  # rows at positions of their own (engine.RowCache): (B, T, 1, head_dim/2) tables
            at = T0[:, None] + torch.arange(T, device=T0.device)
            return self.cos[0, at], self.sin[0, at]
        if T0 + T > self.cos.size(1):
            raise ValueError(f"sequence of {T0 + T} tokens exceeds the rotary table ({self.cos.size(1)})")
        return self.cos[:, T0:T0 + T], self.sin[:, T0:T0 + T]

    def embed(self, idx, kv_cache=None):
        """The recursion's input x = norm(wte(idx)), through the prelude blocks if any (once per forward)."""
        compiled = getattr(self, "_compiled_embed", None)
        if compiled is not None and kv_cache is None:
            x = compiled(self.transformer.wte.weight, idx)
        else:
            x = norm(self.transformer.wte(idx))
        if not self.config.n_prelude:
            return x
        cos_sin = self.rotary(idx.size(1), kv_cache)
        for slot, block in enumerate(self.transformer.prelude):
            x = block(x, cos_sin, kv_cache, slot)
        return norm(x)  # the answer starts as x: at RMS 1, as without a prelude

    def apply_coda(self, y, kv_cache=None, n_sup=1):
        """The answer y through the coda blocks if any, before the head (cached in the last slots of n_sup steps)."""
        if not self.config.n_coda:
            return y
        cos_sin = self.rotary(y.size(1), kv_cache)
        first = self.num_attention_slots(n_sup) - self.config.n_coda
        for i, block in enumerate(self.transformer.coda):
            y = block(y, cos_sin, kv_cache, first + i)
        return y

    def _visit_layer(self, layer, x, y, z, cos_sin, kv_cache, slot):
        block, args = self.transformer.h[layer], (x, y, z, cos_sin, self.config.n_loops,
                                                  state_update_in(self.config.state_update, self.config.state_dtype))
        compiled = getattr(self, "_compiled_visit" if torch.is_grad_enabled() else "_compiled_eval_visit", None)
        if compiled is not None and kv_cache is None:
            return block.visit(*args, compiled=compiled)
        return block.visit(*args, kv_cache, slot)

    def _sweep(self, x, y, z, cos_sin, kv_cache, slot):
        compiled = getattr(self, "_compiled_sweep" if torch.is_grad_enabled() else "_compiled_eval_sweep", None)
        checkpointed = self.config.activation_checkpointing and torch.is_grad_enabled()
        if compiled is not None and kv_cache is None and not checkpointed:
            update = state_update_in(self.config.state_update, self.config.state_dtype)
            return compiled(self.transformer.h, x, y, z, cos_sin, self.config.n_loops, update)
        for layer in range(self.config.n_layer):
            s = slot + layer * (self.config.n_loops + 1)
            if self.config.activation_checkpointing and torch.is_grad_enabled() and kv_cache is None:
                y, z = checkpoint(self._visit_layer, layer, x, y, z, cos_sin, None, s, use_reentrant=False)
            else:
                y, z = self._visit_layer(layer, x, y, z, cos_sin, kv_cache, s)
        return y, z

    def refine(self, idx, n_sup, kv_cache=None, x=None):
        """Yield the states (y, z) after each of n_sup supervision steps (x: the embedded input, if precomputed).
        Sending the generator a (B',) index of rows continues only those rows (their cache narrowed by the caller)."""
        c = self.config
        cos_sin = self.rotary(idx.size(1), kv_cache)
        x = self.embed(idx, kv_cache) if x is None else x
        if c.state_dtype != "float32":  # cast once here; each state update casts its result (state_update_in)
            if not torch.is_autocast_enabled(x.device.type) and self.lm_head.weight.dtype == torch.float32:
                raise ValueError(f"GPTConfig.state_dtype={c.state_dtype!r} needs autocast: run under torch.autocast")
            x = x.to(STATE_DTYPES[c.state_dtype])
        y = x
        z = torch.zeros_like(x) if c.n_loops else None
        slots_per_sweep = c.n_layer * (c.n_loops + 1)  # a plain block (n_loops=0) attends once
        slot = c.n_prelude
        for step in range(n_sup):
            for sweep in range(c.T_recursion):
                with torch.set_grad_enabled(torch.is_grad_enabled() and sweep == c.T_recursion - 1):
                    y, z = self._sweep(x, y, z, cos_sin, kv_cache, slot)
                slot += slots_per_sweep
            rows = yield y, z
            if rows is not None:  # sent by the caller (halting.forward_halting): only these rows go on refining
                x, y, z = x[rows], y[rows], (z[rows] if z is not None else None)
                cos_sin = tuple(t[rows] if t.size(0) > 1 else t for t in cos_sin)
            if self.cuts_after(step):
                y, z = y.detach(), (z.detach() if z is not None else None)
            if c.n_loops and c.state_update in STEP_ENDS:
                y, z = STEP_ENDS[c.state_update](y, z)

    def cuts_after(self, step):
        """Whether the state is detached after supervision step `step` (0-based): truncated backpropagation."""
        return self.config.detach_between_steps and (step + 1) % self.config.backprop_steps == 0

    def head(self, y):
        logits = self.lm_head(norm(y)).float()
        return SOFTCAP * torch.tanh(logits / SOFTCAP)

    def step_loss(self, y, targets, reduction="mean"):
        """One step's loss on answer y. Three paths, for memory only (the values agree): per-token losses without
        gradients (evaluation) and the mean with gradients (training) never hold the whole batch's logits; the rest
        (a probe's per-token losses with gradients, a mean without) computes plain cross-entropy."""
        if reduction == "none" and not torch.is_grad_enabled():  # evaluation: one chunk's logits at a time, as training
            return self.token_losses(y, targets)
        y = self.apply_coda(y)
        if reduction == "mean" and torch.is_grad_enabled():  # training: the batch's logits a chunk at a time
            chunk = getattr(self, "_compiled_head_chunk", normed_head_chunk_loss_and_grads)
            rows = rows_per_chunk(targets.numel(), self.head_chunks, self.config.vocab_size)
            return ChunkedHeadLoss.apply(y.flatten(0, -2), self.lm_head.weight, targets.flatten(), chunk, rows)
        logits = self.head(y)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    def forward(self, idx, targets=None, n_sup=None, kv_cache=None, loss_reduction="mean"):
        """
        model(idx) -> logits (B, T, V) of the last of n_sup (default n_sup_inference) steps.
        model(idx, targets) -> (total, aux): the deep-supervision loss over n_sup (default n_sup_train) steps, and
            aux = {"step_losses": (N,) detached, in order, "refinement": (loss_0 - loss_last) / loss_0}.
        model(idx, targets, loss_reduction="none") -> per-token losses of every step, shape (N, B, T).

        Why training has a second path, forward_backward: total.backward() here must keep every supervision step's
        graph alive until the end, trunk and head; forward_backward backpropagates each step's head as soon as its
        loss is known and the trunk step by step, so only one step's activations are alive. Both compute the same
        loss with the same supervision functions; tests/test_gpt.py checks that their gradients agree.
        """
        c = self.config
        if targets is None:
            n_sup = n_sup or c.n_sup_inference
            for y, _ in self.refine(idx, n_sup, kv_cache):
                pass
            logits = self.head(self.apply_coda(y, kv_cache, n_sup))
            if kv_cache is not None:
                kv_cache.advance(idx.size(1))
            return logits
        step_losses, moves, previous = [], [], None
        for y, _ in self.refine(idx, n_sup or c.n_sup_train):  # one step's state alive at a time in evaluation
            step_losses.append(self.step_loss(y, targets, loss_reduction))
            if previous is not None:
                moves.append(consistency_term(y, previous, c.consistency_weight))
            previous = y if c.consistency_weight and loss_reduction != "none" else None
        if loss_reduction == "none":
            return torch.stack(step_losses)
        total = deep_supervision_loss(step_losses, c.supervision_weight_base, c.improvement_reward_scale, moves)
        return total, loss_aux(torch.stack([l.detach() for l in step_losses]))

    def halt_probability(self, y):
        return torch.sigmoid(self.halt_head(norm(y)).float()).squeeze(-1)

    @torch.no_grad()
    def token_losses(self, y, targets):
        """Per-token cross-entropy (targets -1 give 0) of y's logits, one chunk of logits at a time."""
        return chunked_token_losses(self.head, self.apply_coda(y).flatten(0, -2), targets, self.config.vocab_size)

    def backward_part(self, tensors, grads=None, last=False):
        """backward() for each of forward_backward's backward calls; last marks the final one (into the embedding).
        Unsharded every call is the same; sharding.one_iteration_per_micro_step replaces this method with one that
        lets FSDP finish its iteration only at the last (FSDP would end it at every backward)."""
        backward(tensors, grads)

    def forward_backward(self, idx, targets, loss_scale=1.0, n_sup=None, diagnostics=True):
        """A training micro-step: the loss of model(idx, targets, n_sup=n_sup), backpropagated (scaled by loss_scale).

        Each supervision step's head is backpropagated as soon as its loss is known, into the lm_head and into a
        gradient for that step's answer state y_s; its logits exist one chunk at a time (ChunkedHeadLoss), never as
        a (B, T, vocab) float32 tensor. The trunk (the recursion) is backpropagated from all
        the y_s at the end, or, with detach_between_steps, step by step (every backprop_steps steps), so that only
        one step's activations (one chunk's) are alive either. The gradients equal those of total.backward():
        d total / d loss_s = w_s + c / max(sg(loss_{s-1}), REWARD_LOSS_FLOOR).
        Returns (total, aux) like model(idx, targets), detached, plus aux["state"]: state_diagnostics per step (None
        with diagnostics=False: base_train measures them every --diagnostics_every steps).
        With a halting head, its BCE (halt_head_loss, weight HALT_LOSS_WEIGHT) is backpropagated too and reported as
        aux["halt_loss"] (mean over the steps that have a next one); it is not part of total.
        """
        c = self.config
        n_sup = n_sup or c.n_sup_train
        weights = supervision_weights(n_sup, c.supervision_weight_base)
        x = self.embed(idx)
        x_leaf = x.detach().requires_grad_()  # every step reads x: collect its gradient, backprop into wte once
        step_losses, states, pending = [], [], []  # pending: (y_s, d loss / d y_s) of the trunk, not yet run
        previous = x_leaf.detach()
        halt_losses, previous_token_losses, moves = [], None, []
        for s, (y, z) in enumerate(self.refine(idx, n_sup, x=x_leaf)):
            y_leaf = y.detach().requires_grad_()
            loss = self.step_loss(y_leaf, targets)
            if c.halt_head:
                token_losses = self.token_losses(y_leaf, targets)
                if s:
                    halt_losses.append(halt_head_loss(self, previous, previous_token_losses, token_losses, targets))
                    self.backward_part([halt_losses[-1] * HALT_LOSS_WEIGHT * loss_scale])
                previous_token_losses = token_losses
            weight = weights[s] + (reward_weight(step_losses[-1], c.improvement_reward_scale) if s else 0.0)
            objective = loss
            if s and c.consistency_weight:  # the step's move of the answer, weighed as its loss
                moves.append(consistency_term(y_leaf, previous, c.consistency_weight))
                objective = loss + moves[-1]
            self.backward_part([objective * weight * loss_scale])
            pending.append((y, y_leaf.grad))
            if self.cuts_after(s):  # the next step starts from detached states: these steps' graphs can go now
                self.backward_part(*zip(*pending))
                pending = []
            step_losses.append(loss.detach())
            if diagnostics:
                states.append(state_diagnostics(previous, y, z))
            previous = y.detach()
        if pending:
            self.backward_part(*zip(*pending))
        self.backward_part([x], [x_leaf.grad], last=True)
        total = deep_supervision_loss(step_losses, c.supervision_weight_base, c.improvement_reward_scale,
                                      [m.detach() for m in moves])
        aux = {**loss_aux(torch.stack(step_losses)), "state": torch.stack(states) if diagnostics else None}
        if halt_losses:
            aux["halt_loss"] = torch.stack(halt_losses).detach().mean()
        return total, aux

    @torch.no_grad()
    def diagnose(self, idx, n_sup=None):
        """state_diagnostics of every supervision step on a batch, (n_sup, 4): to see whether the recursion settles."""
        previous, rows = self.embed(idx), []
        for y, z in self.refine(idx, n_sup or self.config.n_sup_inference, x=previous):
            rows.append(state_diagnostics(previous, y, z))
            previous = y
        return torch.stack(rows)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
