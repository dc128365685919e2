"""
Memory of one training micro-batch on one GPU, estimated from the config alone, so a launch script can refuse (or
fix) a batch that would run out of memory before anyone pays for GPU time.

The peak comes at the backward of the last supervision step's head, when every step's trunk graph is still alive:
    parameters (fp32) + gradients (fp32) + optimizer state (Muon momentum, AdamW's two moments; ZeRO-1 sharded
    under DDP) + the low-precision weight copies autocast keeps for backward
    + activations saved for backward by every block application with gradient (each loop, layer and supervision
      step; the no-grad sweeps of T_recursion > 1 save nothing), and the gradient of each step's answer state
    + what ONE supervision step's head holds: GPT.forward_backward backpropagates each head as soon as its loss is
      known, and the chunked head (supervision.ChunkedHeadLoss) keeps (B, T, n_embd) tensors only, never
      (B, T, vocab)
    + the transient working set: the head's chunk of logits and the lm_head gradient it accumulates, or one
      recomputed layer visit under activation checkpointing. The chunk is HEAD_CHUNK_ELEMENTS logits by default; a
      run's plan takes the fewest chunks the memory leaves room for (head_chunks_that_fit), one where it can.

Under FSDP (--sharding=fsdp) the weights, gradients, optimizer state and EMA are divided over the ranks; what is
whole at the peak is one block's gathered weights and gradient (plus the next block's, prefetched), and lm_head's,
gathered for the whole micro-step; autocast keeps no weight copies (the gathered weights are already bf16 on CUDA).

With detach_between_steps, the trunk is backpropagated step by step as well (every backprop_steps steps), so one
step's activations (backprop_steps steps') are alive.
With sample_n_sup, a batch may train up to 2 * n_sup_train - 1 steps (uniform; 4x lognormal_poisson): the estimate
covers that deepest batch.

The counts follow eager PyTorch tensor by tensor (listed in _block_bytes_per_token). torch.compile fuses pointwise
ops and saves fewer tensors (measured on CPU inductor: about half of eager's activations), so for a compiled run
this errs on the safe side.
"""

import functools
import math
from typing import NamedTuple

import torch

from nanochat.model.gpt import GPT, GPTConfig, mlp_hidden
from nanochat.model.supervision import default_head_rows, rows_per_chunk
from nanochat.train.depth import deepest_train_depth
from nanochat.train.flops import estimate_flops, recompute_flops

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Of a GPU's memory, how much a training process can count on: the rest goes to the CUDA context, NCCL buffers,
# allocator fragmentation and torch.compile's workspaces.
USABLE_FRACTION = 0.85


def _state_bytes(config):
    """Bytes per element of the recursion state x, y, z (GPTConfig.state_dtype; float32 unless bf16 is asked for)."""
    return 2 if config.state_dtype == "bfloat16" else 4


def _block_bytes_per_token(config, dtype):
    """Bytes that one block application D(u) = attn + mlp saves for backward, per token.

    The residual stream is float32 (or GPTConfig.state_dtype); under autocast (bf16/fp16) every linear saves its
    own low-precision copy of its input, and q and k stay in that precision through the rotary embedding and QK-norm.
    """
    C = config.n_embd
    Ckv = config.n_kv_head * (config.n_embd // config.n_head)
    act = DTYPE_BYTES[dtype]
    autocast = act < 4
    residual_inputs = 2 * _state_bytes(config) * C  # u and u + attn(u), saved by the two RMSNorms
    # fp32: the norm outputs are shared by the linears that read them; autocast casts them once per linear
    linear_inputs = (4 if autocast else 2) * act * C
    rotary = act * (C + Ckv)  # rotated q and k, saved by QK-norm
    attention = act * (C + 2 * Ckv) + act * C  # the q, k, v that attention saves, and its output (c_proj's input)
    hidden = mlp_hidden(config)
    # relu^2 saves relu's output and its square; gated: fc's output (gate and up), the activation and the product
    mlp = act * (2 * hidden if config.activation_fn == "relu_squared" else 4 * hidden)
    return residual_inputs + linear_inputs + rotary + attention + mlp


def _head_bytes_per_token(config):
    """What one supervision step's head holds per token, all float32 (n_embd,): y for the final norm, norm(y), and
    the gradient for it that ChunkedHeadLoss computes in forward (no (vocab,) tensor: see _head_chunk_bytes)."""
    return 3 * 4 * config.n_embd


# Bytes a logit of the head's chunk at its peak: eager supervision.head_chunk_loss_and_grads holds 3 float32 tensors
# the size of the chunk's logits (3.8 with autocast's bf16 logits and gradient; measured on CPU), counted as 4; the
# compiled fusable chunk 8.3 bytes under bf16 autocast on CPU inductor, counted as 10 until a GPU measures it
# (dev/gpu_gap.py reports the peak of 1, 4 and 16 chunks).
HEAD_BYTES_PER_LOGIT = {"eager": 16, "compiled": 10}


def _head_chunk_bytes(config, tokens, head_chunks=None, compiled=False):
    """The chunked head's working set: one chunk's logits (head_chunks equal chunks, None: the default chunk) and
    the float32 lm_head gradient (accumulated over the chunks, or cast from the one chunk's)."""
    chunk_rows = min(tokens, rows_per_chunk(tokens, head_chunks, config.vocab_size))
    per_logit = HEAD_BYTES_PER_LOGIT["compiled" if compiled else "eager"]
    return per_logit * chunk_rows * config.vocab_size + 4 * config.vocab_size * config.n_embd


def _param_counts(config):
    c = config  # cached on the fields that shape the parameters: fit_micro_batch asks many times
    return _param_counts_cached(c.vocab_size, c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.activation_fn,
                                c.sequence_len, c.n_loops, c.state_update, c.n_prelude, c.n_coda, c.halt_head)


@functools.lru_cache(maxsize=64)
def _param_counts_cached(vocab_size, n_layer, n_embd, n_head, n_kv_head, activation_fn, sequence_len, n_loops,
                         state_update, n_prelude, n_coda, halt_head):
    config = GPTConfig(vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head,
                       activation_fn=activation_fn, sequence_len=sequence_len, n_loops=n_loops,
                       state_update=state_update, n_prelude=n_prelude, n_coda=n_coda, halt_head=halt_head)
    with torch.device("meta"):  # shapes only: no memory, no init
        model = GPT(config)
    trunk = [p for block in model.blocks() for p in block.parameters()]  # the recursion's, prelude's and coda's
    matrix_shapes = {}  # Muon groups its matrices by shape
    for p in trunk:
        if p.ndim == 2:
            matrix_shapes.setdefault(tuple(p.shape), []).append(p.numel())
    # AdamW: the embedding, lm_head, the per-channel decays of state_update="decay" and the halting head
    adamw = [p.numel() for p in (model.transformer.wte.weight, model.lm_head.weight)]
    adamw += [p.numel() for p in trunk if p.ndim < 2]
    adamw += [p.numel() for p in model.halt_head.parameters()] if halt_head else []
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    largest_block = max(sum(p.numel() for p in block.parameters()) for block in model.blocks())
    return model.num_params(), matrix_shapes, adamw, buffers, largest_block


def estimate_memory(config, device_batch_size, dtype="bfloat16", world_size=1, ema=False, sharding="ddp",
                    head_chunks=None, compiled=False):
    """Peak bytes of one rank during a training micro-step: a dict of the parts and their "total".

    config: a GPTConfig (sequence_len is the micro-batch's T); dtype: the autocast dtype ("float32" = no autocast);
    ema: whether the run keeps an EMA of the weights (a float32 copy of every parameter on every rank);
    sharding: "ddp" (replicated weights, ZeRO-1 optimizer state) or "fsdp" (everything sharded, see above);
    head_chunks: the training head's chunks per micro-batch (None: HEAD_CHUNK_ELEMENTS logits a chunk);
    compiled: whether the head's chunk is compiled (--compile), which holds fewer bytes a logit.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    c = config
    tokens = device_batch_size * c.sequence_len
    n_params, matrix_shapes, adamw, buffers, largest_block = _param_counts(c)
    n_matrix = sum(sum(sizes) for sizes in matrix_shapes.values())
    # DistMuon: each rank keeps momentum for every world_size-th matrix of a shape group (rank 0 owns the most)
    muon_state = sum(math.ceil(len(sizes) / world_size) * sizes[0] for sizes in matrix_shapes.values())
    # DistAdamW: exp_avg and exp_avg_sq for this rank's 1/world_size slice of each (zero-padded) parameter
    adamw_state = 2 * sum(math.ceil(n / world_size) for n in adamw)
    # a bounded state update saves its float32 result's input for the norm (or the state, for the decay's gradient)
    S = _state_bytes(c)
    block = _block_bytes_per_token(c, dtype) + (S * c.n_embd if c.n_loops and c.state_update != "residual" else 0)
    deepest = deepest_train_depth(c)
    # trunk graphs alive at once (see forward_backward): one chunk of backprop_steps when detached
    steps_alive = min(c.backprop_steps, deepest) if c.detach_between_steps else deepest
    visits = steps_alive * c.n_layer  # layer visits with gradient (the last sweep of each supervision step)
    deltas_per_visit = c.n_loops + 1 if c.n_loops else 1
    if c.activation_checkpointing:
        # a checkpointed visit keeps only its inputs y and z (x is shared); backward recomputes one visit at a time
        activations = visits * (2 if c.n_loops else 1) * S * c.n_embd * tokens
        recompute = deltas_per_visit * block * tokens
    else:
        activations = visits * deltas_per_visit * block * tokens
        recompute = 0
    # the prelude's graph waits for the final backward into the embedding; one step's coda for that step's head
    activations += (c.n_prelude + c.n_coda) * _block_bytes_per_token(c, dtype) * tokens
    # one head at a time; every step's answer state and its gradient wait for the trunk's backward
    logits = _head_bytes_per_token(c) * tokens + steps_alive * 2 * S * c.n_embd * tokens
    transient = max(_head_chunk_bytes(c, tokens, head_chunks, compiled), recompute)
    if sharding == "fsdp":
        parts = _sharded_state(n_params, n_matrix, adamw, buffers, largest_block, dtype, world_size, ema)
    else:
        parts = _replicated_state(n_params, n_matrix, muon_state, adamw, adamw_state, buffers, dtype, ema)
    parts.update(activations=activations, logits=logits, transient=transient)
    # evaluation runs between steps, gradients freed (zero_grad(set_to_none)): the plan holds the larger peak
    parts["evaluation"] = max(0, evaluation_bytes(c, device_batch_size, dtype)
                              - (parts["grads"] + activations + logits + transient))
    parts["total"] = sum(parts.values())
    return parts


def evaluation_bytes(config, device_batch_size, dtype="bfloat16"):
    """Evaluation's working set (loss_eval.evaluate_bpb) beside the weights and optimizer state: no gradient and no
    stored activation; the states x, y, z (float32 or GPTConfig.state_dtype) and the diagnostics' previous y, every
    step's per-token losses, and at its peak either one block application's tensors or the head's chunk of logits
    (GPT.token_losses)."""
    c = config
    tokens = device_batch_size * c.sequence_len
    chunk_rows = min(tokens, default_head_rows(c.vocab_size))
    states = (4 * _state_bytes(c) * c.n_embd + 4 * c.n_sup_inference) * tokens
    return states + max(_block_bytes_per_token(c, dtype) * tokens, 4 * 4 * chunk_rows * c.vocab_size)


def _replicated_state(n_params, n_matrix, muon_state, adamw, adamw_state, buffers, dtype, ema):
    """DDP: every rank holds the float32 weights, gradients, EMA and autocast's weight copies; ZeRO-1 optimizer."""
    return {
        "params": 4 * n_params * (2 if ema else 1) + buffers,
        "grads": 4 * n_params,
        "optimizer": 4 * (muon_state + adamw_state),
        "weight_copies": DTYPE_BYTES[dtype] * (n_matrix + adamw[1]) if DTYPE_BYTES[dtype] < 4 else 0,
    }


def _sharded_state(n_params, n_matrix, adamw, buffers, block, dtype, world_size, ema):
    """FSDP: 1/world_size of the float32 weights, gradients, EMA and optimizer state (Muon's momentum, AdamW's two
    moments: all row-sharded like their weights); whole: at the peak (a block's backward, measured on CPU) the block's
    gathered weights and gradient, the next block being gathered (FSDP's all-gather buffer and the weights copied out
    of it), the previous block's float32 gradient in its reduce-scatter buffer, and lm_head's weights and gradient
    (gathered for the micro-step). Gathered tensors are in the compute dtype (bf16 on GPUs)."""
    share = lambda n: math.ceil(n / world_size)  # noqa: E731 - FSDP pads dim 0: at most one row more per rank
    gathered = DTYPE_BYTES[dtype]
    lm_head = adamw[1]
    return {
        "params": 4 * share(n_params) * (2 if ema else 1) + buffers,
        "grads": 4 * share(n_params),
        "optimizer": 4 * (share(n_matrix) + 2 * share(sum(adamw))),
        "gathered": (3 * gathered + 8) * block + (gathered + 4) * lm_head,
    }


def sharded_build_host_bytes(config, processes):
    """Host RAM that starting `processes` FSDP ranks on one node needs, all at once: each shards the model before its
    weights exist and draws them one at a time whole on the CPU, keeping its rows (sharding.build_sharded_model), so
    it holds the largest float32 weight (the embedding or lm_head at usual sizes) beyond its shards, which are on the
    device (on a CPU device they are the device memory the plan counts)."""
    with torch.device("meta"):  # shapes only; every block has the same weights, one is enough
        model = GPT(config.replace(n_layer=1, n_prelude=0, n_coda=0))
    return processes * 4 * max(p.numel() for p in model.parameters())


def usable_bytes(total_bytes):
    return int(USABLE_FRACTION * total_bytes)


# Small micro-batches run below a large one's FLOP rate (kernel launches and host work per micro-batch, smaller
# matmuls): a micro-batch of n tokens is planned at n / (n + MICRO_BATCH_OVERHEAD_TOKENS) of the rate of an unbounded
# one. Fit to the default TRM at depth 12 (width 768, 2048-token rows) on one GPU: 41.9% MFU at 16 rows on an H100
# (dev/LOG.md, issue 40), 47.5% at 32 rows on an H200 (2026-11-27), the H200's 1.10x over the H100 taken from the
# plain model measured on both at 32 rows (40.2%, 44.3%): halving the micro-batch from 32 rows to 16 cost 3%, a fixed
# cost worth ~1,900 tokens a micro-batch. dev/gpu_gap.py's trm_holding variants measure it at the planner's batch.
MICRO_BATCH_OVERHEAD_TOKENS = 1900


def micro_batch_efficiency(tokens):
    """The planned share of a large micro-batch's FLOP rate that a micro-batch of `tokens` tokens reaches."""
    return tokens / (tokens + MICRO_BATCH_OVERHEAD_TOKENS)


class MicroBatch(NamedTuple):
    """A device batch that fits, and its planned time per token relative to the same FLOPs without recomputation in
    unbounded micro-batches: (1 + recomputed share) / micro_batch_efficiency."""
    batch: int
    checkpointing: bool
    time: float


class MicroBatchChoice(NamedTuple):
    chosen: MicroBatch
    other: MicroBatch | None  # the best batch of the other kind (recompute or not), None where none fits or allowed


@functools.lru_cache(maxsize=64)
def _recompute_share(fields):
    with torch.device("meta"):  # shapes only
        model = GPT(GPTConfig(**dict(fields)))
    return recompute_flops(model) / estimate_flops(model)


def recompute_share(config):
    """The FLOPs activation checkpointing adds to a training step, as a share of the step's model FLOPs: one more
    forward of every layer visit with gradient, about a third for the recursion (flops.recompute_flops)."""
    return _recompute_share(tuple(sorted(config.replace(activation_checkpointing=False).to_dict().items())))


def choose_micro_batch(config, sequences_per_rank, max_batch, memory_bytes, dtype="bfloat16", world_size=1,
                       allow_checkpointing=True, ema=False, sharding="ddp"):
    """The device batch (and activation checkpointing) that fits memory_bytes and trains fastest by the planned time:
    the largest batch that fits as it is (more accumulation when it is small) against, when allowed, the largest
    that fits with every layer visit recomputed in backward; a MicroBatchChoice, None when not even one sequence fits.

    Only max_batch and batches that divide sequences_per_rank are considered, so gradient accumulation keeps the
    effective batch exactly. A config that asks for checkpointing keeps it. On equal time, no recomputation.
    """
    budget = usable_bytes(memory_bytes)
    fits = lambda cfg, b: estimate_memory(cfg, b, dtype, world_size, ema, sharding)["total"] <= budget  # noqa: E731
    batches = [max_batch] + [b for b in range(min(max_batch, sequences_per_rank), 0, -1)
                             if sequences_per_rank % b == 0 and b != max_batch]
    kinds = [True] if config.activation_checkpointing else [False] + ([True] if allow_checkpointing else [])
    share = recompute_share(config)
    found = []
    for checkpointing in kinds:
        cfg = config.replace(activation_checkpointing=checkpointing)
        b = next((b for b in batches if fits(cfg, b)), None)
        if b is not None:
            time = (1 + share * checkpointing) / micro_batch_efficiency(b * config.sequence_len)
            found.append(MicroBatch(b, checkpointing, time))
    if not found:
        return None
    found.sort(key=lambda m: (m.time, m.checkpointing))
    return MicroBatchChoice(found[0], found[1] if len(found) > 1 else None)


def fit_micro_batch(config, sequences_per_rank, max_batch, memory_bytes, dtype="bfloat16", world_size=1,
                    allow_checkpointing=True, ema=False, sharding="ddp"):
    """(device_batch_size, activation_checkpointing) of choose_micro_batch; None when not even one sequence fits."""
    choice = choose_micro_batch(config, sequences_per_rank, max_batch, memory_bytes, dtype, world_size,
                                allow_checkpointing, ema, sharding)
    return None if choice is None else (choice.chosen.batch, choice.chosen.checkpointing)


def head_chunks_that_fit(config, device_batch_size, memory_bytes, dtype="bfloat16", world_size=1, ema=False,
                         sharding="ddp", compiled=False):
    """The fewest equal chunks (1, 2, 4, ...) the training head can take at this micro-batch within memory_bytes'
    usable share: one compiled region over the micro-batch where it fits. None when no chunk larger than the default
    (HEAD_CHUNK_ELEMENTS logits) fits: the head keeps the default chunk."""
    tokens = device_batch_size * config.sequence_len
    if tokens <= default_head_rows(config.vocab_size):
        return 1  # the default chunk already holds the micro-batch
    budget, chunks = usable_bytes(memory_bytes), 1
    while -(-tokens // chunks) > default_head_rows(config.vocab_size):
        if estimate_memory(config, device_batch_size, dtype, world_size, ema, sharding, chunks,
                           compiled)["total"] <= budget:
            return chunks
        chunks *= 2
    return None


# ---------------------------------------------------------------------------------------------------- communication
def collective_bytes(config, sharding, world_size, grad_accum, dtype="bfloat16"):
    """Bytes each rank sends per optimizer step (a ring collective moves (world-1)/world of its tensor through every
    rank), and a dict of how many parameter all-gathers one micro-step makes.

    ddp: one reduce-scatter of the float32 gradients and one all-gather of the float32 weights per step (ZeRO-1),
    whatever the accumulation. fsdp, per micro-step: every block is gathered (in the compute dtype) once per layer
    visit (its n_loops+1 calls share it), forward and again for its backward (activation checkpointing recomputes
    while it is gathered: no more), and its float32 gradient reduce-scattered once per backward call (per
    supervision step when detached); the embedding twice, lm_head once (whole for the micro-step) and reduced per
    step; then ShardedMuon's two all_to_alls of every matrix per step. Counted by dev/bench_fsdp.py on Gloo: 35
    all-gathers per micro-step at depth 4, n_loops 2, 4 supervision steps."""
    c = config
    n_params, matrix_shapes, adamw, _, block = _param_counts(c)
    ring = (world_size - 1) / world_size
    if sharding == "ddp":
        return 8 * n_params * ring, {}
    g = DTYPE_BYTES[dtype]
    steps = deepest_train_depth(c)
    grad_visits, nograd_visits = steps, steps * (c.T_recursion - 1)  # per layer; one gather per visit (Block.visit)
    backward_calls = math.ceil(steps / c.backprop_steps) if c.detach_between_steps else 1
    gathers = {"recursion": c.n_layer * (2 * grad_visits + nograd_visits), "prelude": 2 * c.n_prelude,
               "coda": 2 * steps * c.n_coda, "embedding and lm_head": 3}
    block_gathers = sum(gathers.values()) - gathers["embedding and lm_head"]
    reduces = c.n_layer * backward_calls + c.n_prelude + c.n_coda * steps
    root = g * (2 * adamw[0] + adamw[1]) + 4 * (adamw[0] + steps * adamw[1])  # gathered; reduced
    micro = g * block * block_gathers + 4 * block * reduces + root
    muon = 2 * 4 * sum(sum(sizes) for sizes in matrix_shapes.values())
    return (grad_accum * micro + muon) * ring, gathers
