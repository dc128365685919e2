"""nanochat.train.memory against measured peak memory of real training steps on CPU, and the batch fit built on it."""

import itertools

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.depth import deepest_train_depth
from nanochat.train.memory import estimate_memory, fit_micro_batch, usable_bytes
from nanochat.train.optim import clipped_step, reduce_gradients, setup_optimizers

# a fixed depth (training_steps trains n_sup_train steps, the estimate plans for the deepest a sampler can draw)
SMALL = GPTConfig(sequence_len=64, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=128, n_loops=2,
                  n_sup_train=2, sample_n_sup=False, detach_between_steps=True, backprop_steps=1)
HOLDING = SMALL.replace(sample_n_sup="lognormal_poisson", backprop_steps=4, state_update="trm")


def training_steps(config, batch, dtype, head_chunks=None):
    """Two optimizer steps as base_train runs them, at the deepest step count the config can draw (what the estimate
    plans for); gradients kept between steps so the second step's backward holds parameters, gradients, optimizer
    state and activations at once (the steady state of accumulation)."""
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    model.head_chunks = head_chunks
    optimizers = setup_optimizers(model)
    idx = torch.randint(0, config.vocab_size, (batch, config.sequence_len))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            model.forward_backward(idx, idx, n_sup=deepest_train_depth(config))
        clipped_step(optimizers, reduce_gradients(optimizers).sqrt().item(), 1.0)  # base_train's update


def measured_peak(config, batch, dtype, head_chunks=None):
    """Peak bytes of live CPU tensors during training_steps.

    With profile_memory=True the CPU allocator reports every allocation and free to the profiler as a "[memory]"
    event of +/- its bytes; their running sum in time order is the bytes allocated since profiling started and not yet
    freed (the chrome trace's "Total Allocated", read here without writing and parsing a trace of tens of MB). The
    model is built inside the profiled region, so its maximum is the peak of all tensor memory of the run. (RSS
    would also count the allocator's cache, the Python heap and libraries; this counts exactly the tensors.)
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        training_steps(config, batch, dtype, head_chunks)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    assert events, "the profiler reported no allocation"
    return max(itertools.accumulate(e.nbytes() for e in events))


@pytest.mark.parametrize("config, batch, dtype", [
    (SMALL, 4, "float32"),
    (SMALL, 4, "bfloat16"),  # autocast: low-precision copies of weights and linear inputs
    (SMALL.replace(detach_between_steps=True, backprop_steps=1), 4, "float32"),
    (SMALL.replace(activation_checkpointing=True), 4, "float32"),
    (SMALL.replace(vocab_size=4096, n_embd=64, n_head=1, n_kv_head=1), 4, "bfloat16"),  # logits dominate
    (SMALL.replace(n_loops=0, n_sup_train=3, activation_fn="swiglu", n_kv_head=1), 4, "float32"),
    (SMALL.replace(vocab_size=8192, n_embd=64, n_head=1, n_kv_head=1, n_sup_train=4), 4, "float32"),
    (SMALL.replace(state_update="trm", n_sup_train=3), 4, "float32"),
    (SMALL.replace(state_update="decay"), 4, "bfloat16"),
    (SMALL.replace(n_loops=1, n_prelude=2, n_coda=2), 4, "float32"),
    # a bf16 recursion state; slow (a minute of profiling): bf16 autocast is checked at 64 tokens above
    pytest.param(SMALL.replace(sequence_len=256, n_embd=256, state_dtype="bfloat16"), 4, "bfloat16",
                 marks=pytest.mark.slow),
    # issue 57's recipe: log-normal draws up to 4 x 2 steps, gradients through 4 steps (4 steps' graphs alive), with
    # and without every layer visit recomputed in backward
    (HOLDING, 4, "float32"),
    (HOLDING.replace(activation_checkpointing=True), 4, "float32"),
    # slow (over a minute of profiling): the recomputation is checked in fp32 above, autocast at 64 tokens
    pytest.param(HOLDING.replace(activation_checkpointing=True, sequence_len=256), 4, "bfloat16",
                 marks=pytest.mark.slow),
], ids=["fp32", "bf16", "detach", "checkpointing", "large-vocab", "plain-swiglu-gqa", "vocab-8k-4-steps", "trm",
        "decay-bf16", "prelude-coda", "bf16-state", "holding", "holding-recompute", "holding-recompute-bf16"])
def test_estimate_within_25_percent_of_measured_peak(config, batch, dtype):
    estimate = estimate_memory(config, batch, dtype)["total"]
    measured = measured_peak(config, batch, dtype)
    assert abs(estimate - measured) <= 0.25 * measured, f"estimate {estimate:,} vs measured {measured:,}"


@pytest.mark.parametrize("head_chunks", [None, 2, 1])
def test_the_head_planned_in_fewer_chunks_is_estimated_within_25_percent(head_chunks, monkeypatch):
    # a vocabulary-heavy model whose default chunk is 16 rows of the micro-batch's 256: the plan's 2 or 1 chunks hold
    # 8x and 16x the logits at once, and the estimate follows them
    from nanochat.model import supervision
    config = SMALL.replace(vocab_size=8192, n_embd=64, n_head=1, n_kv_head=1)
    monkeypatch.setattr(supervision, "HEAD_CHUNK_ELEMENTS", 16 * config.vocab_size)
    estimate = estimate_memory(config, 4, "bfloat16", head_chunks=head_chunks)["total"]
    measured = measured_peak(config, 4, "bfloat16", head_chunks)
    assert abs(estimate - measured) <= 0.25 * measured, f"estimate {estimate:,} vs measured {measured:,}"


def test_the_plan_gives_the_head_the_fewest_chunks_its_memory_holds():
    from nanochat.train.memory import head_chunks_that_fit
    # 32 x 2048 rows, vocab 65,536: one float32 logits tensor of the micro-batch is 17 GB; one step's graph alive
    # (the default's 4 steps of 32 rows fit no single GPU, so its plan takes fewer rows)
    d12 = GPTConfig(sample_n_sup=False, backprop_steps=1)
    need = lambda chunks, compiled=False: estimate_memory(d12, 32, head_chunks=chunks, compiled=compiled)["total"]
    for memory in (80e9, 141e9, 300e9):
        for compiled in (False, True):
            chunks = head_chunks_that_fit(d12, 32, memory, compiled=compiled)
            if chunks is None:  # only the default chunk fits
                assert need(8, compiled) > usable_bytes(memory)
                continue
            assert need(chunks, compiled) <= usable_bytes(memory)
            assert chunks == 1 or need(chunks // 2, compiled) > usable_bytes(memory)
    assert head_chunks_that_fit(d12, 32, 300e9) == 1 and head_chunks_that_fit(d12, 32, 141e9) == 4
    assert head_chunks_that_fit(d12, 32, 141e9, compiled=True) == 2  # the compiled chunk holds fewer bytes a logit
    assert head_chunks_that_fit(d12, 32, 40e9) is None  # the default 4,096-row chunk and no larger
    assert head_chunks_that_fit(d12.replace(sequence_len=1024), 1, 1e9) == 1  # within one default chunk already


def test_the_parts_move_the_way_the_model_does():
    # depth 12, n_loops 2, 4 steps, vocab 65536, 2048 tokens, all graphs alive
    d12 = GPTConfig(detach_between_steps=False, sample_n_sup=False)
    plain = estimate_memory(d12, 1)
    tokens = d12.sequence_len
    # stored activations of 4 steps x 12 layers x 3 block applications, ~37 kB each: ~5 MB per token
    assert 4e6 < plain["activations"] / tokens < 6e6
    # checkpointing keeps only each layer visit's inputs; logits are untouched
    ckpt = estimate_memory(d12.replace(activation_checkpointing=True), 1)
    assert ckpt["activations"] < plain["activations"] / 10 and ckpt["logits"] == plain["logits"]
    # the chunked head holds (B, T, n_embd) tensors, never (B, T, vocab): its part does not grow with the vocabulary
    assert estimate_memory(d12.replace(vocab_size=2 * d12.vocab_size), 1)["logits"] == plain["logits"]
    # and its working set is one chunk of logits (4,096 rows: 2 sequences) and lm_head's gradient, however large the
    # batch
    assert estimate_memory(d12, 32)["transient"] == estimate_memory(d12, 2)["transient"] < 5e9
    assert plain["transient"] < estimate_memory(d12, 2)["transient"]  # 2,048 rows: less than a chunk
    # detach_between_steps backpropagates the trunk step by step too: one step's activations alive at a time
    detached = estimate_memory(d12.replace(detach_between_steps=True, backprop_steps=1), 1)
    assert detached["activations"] == plain["activations"] / 4
    # truncated backpropagation through 2 steps: two steps' activations alive at a time
    truncated = estimate_memory(d12.replace(detach_between_steps=True, backprop_steps=2), 1)
    assert truncated["activations"] == plain["activations"] / 2
    # a sampled depth of up to 2 * 4 - 1 steps keeps the deepest batch's activations
    assert estimate_memory(d12.replace(sample_n_sup=True), 1)["activations"] == plain["activations"] * 7 / 4
    # the log-normal draw reaches 4 * 4 steps; detached every 4 (the holding recipe of issue 51) 4 steps are alive
    assert estimate_memory(d12.replace(sample_n_sup="lognormal_poisson"), 1)["activations"] == 4 * plain["activations"]
    holding = GPTConfig(sample_n_sup="lognormal_poisson", backprop_steps=4)
    assert estimate_memory(holding, 1)["activations"] == plain["activations"]
    # no-grad sweeps (T_recursion > 1) store nothing
    assert estimate_memory(d12.replace(T_recursion=3), 1)["activations"] == plain["activations"]
    # activations scale with supervision steps and loops
    assert estimate_memory(d12.replace(n_sup_train=8), 1)["activations"] == 2 * plain["activations"]
    # ZeRO-1: optimizer state shrinks with the world size, parameters and gradients do not
    sharded = estimate_memory(d12, 1, world_size=8)
    assert sharded["optimizer"] < plain["optimizer"] / 6 and sharded["grads"] == plain["grads"]


def test_fit_keeps_effective_batch_and_weighs_more_accumulation_against_recompute_by_time():
    from nanochat.train import memory
    d12 = GPTConfig(detach_between_steps=False, sample_n_sup=False)  # all 4 steps' graphs alive: the most memory
    mem = 80e9
    fits = lambda c, n: estimate_memory(c, n)["total"] <= usable_bytes(mem)  # noqa: E731
    assert not fits(d12, 32)
    # the guides' d12 batch of 32 x 2048 does not fit: the largest batch that does (4 rows, 8,192-token micro-batches
    # at 81% of a large one's rate) is planned faster than recomputing every layer visit at 32 rows (+29% FLOPs)
    choice = memory.choose_micro_batch(d12, 64, 32, mem)
    b, other = choice.chosen, choice.other
    assert (b.batch, b.checkpointing, other.checkpointing) == (4, False, True) and 64 % b.batch == 0
    assert fits(d12, b.batch) and not any(fits(d12, n) for n in range(b.batch + 1, 33) if 64 % n == 0)
    assert other.batch == 32 and fits(d12.replace(activation_checkpointing=True), 32)
    share = memory.recompute_share(d12)
    assert 0.25 < share < 1 / 3  # one more forward of the trunk; the heads are not recomputed
    assert b.time == pytest.approx(1 / memory.micro_batch_efficiency(4 * 2048)) and b.time < other.time
    assert other.time == pytest.approx((1 + share) / memory.micro_batch_efficiency(32 * 2048))
    assert fit_micro_batch(d12, 64, 32, mem) == (4, False)
    # were small micro-batches 10x as costly, recomputation would win the same plan
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "MICRO_BATCH_OVERHEAD_TOKENS", 10 * memory.MICRO_BATCH_OVERHEAD_TOKENS)
        assert fit_micro_batch(d12, 64, 32, mem) == (32, True)
    # a batch that fits as it is stays; recomputation never beats it
    assert fit_micro_batch(d12.replace(sequence_len=64), 64, 32, mem) == (32, False)
    # a model whose only batches without recompute are 1 or 2 rows recomputes at a larger one
    deep = d12.replace(n_layer=24, n_embd=1536, n_head=12, n_kv_head=12)
    b, checkpointing = fit_micro_batch(deep, 64, 32, mem)
    assert checkpointing and fits(deep.replace(activation_checkpointing=True), b)
    assert max(n for n in range(1, 33) if 64 % n == 0 and fits(deep, n)) <= 2
    # without permission to checkpoint, the batch shrinks further; a config that asks for it keeps it
    assert fit_micro_batch(deep, 64, 32, mem, allow_checkpointing=False)[0] < b
    assert fit_micro_batch(d12.replace(activation_checkpointing=True, sequence_len=64), 64, 32, mem) == (32, True)
    # nothing fits in 1 GB
    assert fit_micro_batch(d12, 64, 32, 1e9) is None


def test_a_bf16_state_plans_less_memory_than_a_float32_state():
    config = SMALL.replace(sequence_len=256, n_embd=256)
    fp32, bf16 = (estimate_memory(config.replace(state_dtype=d), 4, "bfloat16") for d in ("float32", "bfloat16"))
    assert bf16["activations"] < fp32["activations"] and bf16["logits"] < fp32["logits"]
    assert bf16["total"] < fp32["total"]


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="float8"):
        estimate_memory(SMALL, 1, "float8")


def test_a_cpu_run_plans_with_the_ram_the_kernel_can_give_not_only_the_unused(monkeypatch):
    """MemFree leaves out the page cache: after reading files a 24 GB machine showed 2 GB free and 19 GB available."""
    from nanochat.train import planning
    monkeypatch.setattr(planning, "host_ram_available", lambda: 19 * 2**30)
    monkeypatch.setattr(planning.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 2 * 2**30 // 4096,
                                                              "SC_PAGE_SIZE": 4096}[name])
    assert planning.free_ram_per_process(2)[0] == 19 * 2**30 // 2
    monkeypatch.setattr(planning, "host_ram_available", lambda: None)  # no /proc/meminfo: the portable count
    assert planning.free_ram_per_process(2)[0] == 2**30


def test_a_sharded_build_needs_the_largest_float32_weight_of_host_ram_per_process():
    # sharding.build_sharded_model draws one weight at a time whole on the CPU; each process built the whole model
    from nanochat.train.memory import sharded_build_host_bytes
    depth64 = GPTConfig(vocab_size=65536, n_layer=64, n_head=32, n_kv_head=32, n_embd=4096, n_prelude=1, n_coda=1)
    assert sharded_build_host_bytes(depth64, 8) == 8 * 4 * 65536 * 4096  # lm_head (and wte): 8.6 GB, not 430 GB
    # a small vocabulary: the gated MLP's input projection, 2 x 1408 rows of 512, is the largest
    gated = GPTConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=4, n_embd=512, activation_fn="swiglu")
    assert sharded_build_host_bytes(gated, 1) == 4 * 2 * 1408 * 512
