"""Tests for the inference engine: cached decoding against full forwards, sampling, and the sampling CLI."""

import functools
import itertools
import threading

import pytest
import torch

from nanochat.model.engine import (
    Batch,
    Engine,
    KVCache,
    RowCache,
    ends_mid_character,
    forward_at_depths,
    kv_cache_bytes_per_token,
    left_pad,
    sample_next,
)
from nanochat.model.gpt import STATE_UPDATES
from nanochat.model.halting import Draft, Halting, forward_halting, rms_score
from scripts import base_sample
from tests.support import helpers
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

ATOL = 1e-4  # logits are soft-capped at 15; float32 reorderings move them by ~1e-6

# prompts overrun a context of 8, 4 supervision steps to choose from, GPTConfig's default detaching
tiny_config = functools.partial(helpers.tiny_config, sequence_len=8, n_loops=2, n_sup_train=4,
                                detach_between_steps=True)
# every weight random, so a cache that attends over the wrong keys cannot match by accident
random_model = functools.partial(helpers.random_model, every_weight=True)


def cached_logits(model, idx, prompt_len, n_sup, pads=None):
    """Prefill idx[:, :prompt_len], then feed the rest one token at a time; logits at every position."""
    cache = KVCache(model.num_attention_slots(n_sup), idx.size(0), idx.size(1), pads)
    outputs = [model(idx[:, :prompt_len], kv_cache=cache, n_sup=n_sup)]
    for t in range(prompt_len, idx.size(1)):
        outputs.append(model(idx[:, t:t + 1], kv_cache=cache, n_sup=n_sup))
    assert cache.pos == idx.size(1)
    return torch.cat(outputs, dim=1)


def allocated(cache):
    """Bytes held by the cache's key and value tensors."""
    return sum(t.numel() * t.element_size() for t in cache.k + cache.v if t is not None)


# n_loops, T_recursion, n_kv_head (2 = GQA); T_recursion > 1 needs latent loops
CONFIGS = [c for c in itertools.product([0, 1, 2], [1, 2], [4, 2]) if c[0] or c[1] == 1]


@pytest.mark.parametrize("n_loops,T_recursion,n_kv_head", CONFIGS)
@torch.no_grad()
def test_cached_decoding_matches_full_forward(n_loops, T_recursion, n_kv_head):
    config = tiny_config(n_loops=n_loops, T_recursion=T_recursion, n_kv_head=n_kv_head)
    model = random_model(config)
    L = config.sequence_len + 2  # decoding runs past a prompt that fills the context exactly
    idx = torch.randint(0, config.vocab_size, (2, L), generator=torch.Generator().manual_seed(1))
    for n_sup in range(1, 5):
        full = model(idx, n_sup=n_sup)
        assert full.std() > 0.3  # the comparison has signal
        for prompt_len in (1, 4, config.sequence_len):
            cached = cached_logits(model, idx, prompt_len, n_sup)
            torch.testing.assert_close(cached, full, atol=ATOL, rtol=0,
                                       msg=lambda m: f"n_sup={n_sup} prompt_len={prompt_len}: {m}")


class PhysicalLayerCache(KVCache):
    """The mistake this engine replaces: one cache entry per physical layer, shared by every recursion step."""

    def __init__(self, model, batch_size, max_len):
        super().__init__(model.config.n_layer, batch_size, max_len)
        self.applications_per_layer = model.config.n_loops + 1

    def attend(self, slot, q, k, v):
        return super().attend(slot // self.applications_per_layer % self.num_slots, q, k, v)


@torch.no_grad()
def test_comparison_catches_a_cache_shared_across_the_recursion():
    """The equality test is only worth something if a per-physical-layer cache fails it."""
    model = random_model(tiny_config(n_loops=1, n_sup_train=2))
    idx = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    full = model(idx, n_sup=2)
    cache = PhysicalLayerCache(model, 1, 10)
    outputs = [model(idx[:, :4], kv_cache=cache, n_sup=2)]
    outputs += [model(idx[:, t:t + 1], kv_cache=cache, n_sup=2) for t in range(4, 10)]
    assert (torch.cat(outputs, dim=1) - full)[:, 4:].abs().max() > 100 * ATOL


@pytest.mark.parametrize("n_loops,T_recursion,n_kv_head", CONFIGS)
@torch.no_grad()
def test_padded_rows_match_each_row_alone(n_loops, T_recursion, n_kv_head):
    config = tiny_config(n_loops=n_loops, T_recursion=T_recursion, n_kv_head=n_kv_head)
    model = random_model(config)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (1, 7, config.sequence_len)]
    continuation = torch.randint(0, 64, (len(rows), 4), generator=g)
    for n_sup in (1, 4):
        idx, pads = left_pad(rows)
        L = idx.size(1)
        logits = cached_logits(model, torch.cat([idx, continuation], dim=1), L, n_sup, pads)
        for b, row in enumerate(rows):
            alone = model(torch.tensor([row + continuation[b].tolist()]), n_sup=n_sup)[0]
            torch.testing.assert_close(logits[b, L - len(row):], alone, atol=ATOL, rtol=0,
                                       msg=lambda m: f"row of length {len(row)}, n_sup={n_sup}: {m}")


@pytest.mark.parametrize("n_loops,T_recursion,n_kv_head", CONFIGS)
@torch.no_grad()
def test_rows_joining_and_leaving_a_row_cache_match_each_row_alone(n_loops, T_recursion, n_kv_head):
    """Two rows (padded among themselves) decode, a third joins, the first leaves (the third moves into its place):
    every row's logits at every token are those of its full forward alone."""
    config = tiny_config(n_loops=n_loops, T_recursion=T_recursion, n_kv_head=n_kv_head)
    model = random_model(config)
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (2, 7, 5)]
    fed = torch.randint(0, 64, (3, 6), generator=g)  # the tokens each row is fed after its prompt
    n_sup = 2
    cache, logits, done = RowCache(model.num_attention_slots(n_sup)), [[] for _ in rows], [0, 0, 0]

    def join(members):
        idx, pads = left_pad([rows[m] for m in members])
        prefill = KVCache(model.num_attention_slots(n_sup), len(members), idx.size(1), pads)
        for m, out in zip(members, model(idx, kv_cache=prefill, n_sup=n_sup)[:, -1]):
            logits[m].append(out)
        cache.join(prefill, idx.size(1) + fed.size(1))

    def decode(members):
        idx = torch.stack([fed[m, done[m]] for m in members])[:, None]
        for m, out in zip(members, model(idx, kv_cache=cache, n_sup=n_sup)[:, -1]):
            logits[m].append(out)
            done[m] += 1

    join([0, 1])
    decode([0, 1])
    decode([0, 1])
    join([2])
    decode([0, 1, 2])
    order = cache.free([0])  # the last row moves into the first's place
    assert order == [2, 1]
    for _ in range(3):
        decode(order)
    for m, row in enumerate(rows):
        alone = model(torch.tensor([row + fed[m, :done[m]].tolist()]), n_sup=n_sup)[0, len(row) - 1:]
        assert alone.std() > 0.3  # the comparison has signal
        torch.testing.assert_close(torch.stack(logits[m]), alone, atol=ATOL, rtol=0, msg=lambda e: f"row {m}: {e}")


@pytest.mark.parametrize("n_prelude,n_coda", [(0, 0), (1, 1)])
@torch.no_grad()
def test_rows_answering_from_their_own_step_match_each_row_alone(n_prelude, n_coda):
    """Rows of 1, 4 and 2 steps prefilled and decoded together in 4-step forwards (forward_at_depths), a fourth
    joining later: each row's logits at every token are those of its full forward alone at its own depth."""
    model = random_model(tiny_config(n_loops=1, n_prelude=n_prelude, n_coda=n_coda))
    g = torch.Generator().manual_seed(6)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 6, 4, 5)]
    depths, fed, n_sup = [1, 4, 2, 3], torch.randint(0, 64, (4, 4), generator=g), 4
    slots, logits, done = model.num_attention_slots(n_sup), [[] for _ in rows], [0] * 4
    cache = RowCache(slots)

    def join(members):
        idx, pads = left_pad([rows[m] for m in members])
        prefill = KVCache(slots, len(members), idx.size(1), pads)
        out = forward_at_depths(model, idx, n_sup, torch.tensor([depths[m] for m in members]), prefill)
        for m, last in zip(members, out[:, -1]):
            logits[m].append(last)
        cache.join(prefill, idx.size(1) + fed.size(1))

    def decode(members):
        idx = torch.stack([fed[m, done[m]] for m in members])[:, None]
        out = forward_at_depths(model, idx, n_sup, torch.tensor([depths[m] for m in members]), cache)
        for m, last in zip(members, out[:, -1]):
            logits[m].append(last)
            done[m] += 1

    join([0, 1, 2])
    decode([0, 1, 2])
    join([3])
    for _ in range(3):
        decode([0, 1, 2, 3])
    for m, row in enumerate(rows):
        alone = model(torch.tensor([row + fed[m, :done[m]].tolist()]), n_sup=depths[m])[0, len(row) - 1:]
        deepest = model(torch.tensor([row + fed[m, :done[m]].tolist()]), n_sup=n_sup)[0, len(row) - 1:]
        assert depths[m] == n_sup or (alone - deepest).abs().max() > 0.1  # its own step differs from the last
        torch.testing.assert_close(torch.stack(logits[m]), alone, atol=ATOL, rtol=0, msg=lambda e: f"row {m}: {e}")


@torch.no_grad()
def test_rows_that_halt_leave_the_recursion_and_get_what_holding_gives(monkeypatch):
    """Decoding over a RowCache, a row that halts stops refining while the others go on (later steps compute fewer
    rows); each row's logits and steps are those of its decoding alone, where a halted token's keys are held."""
    model = random_model(tiny_config(n_loops=1))
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 6, 4, 5)]
    fed = torch.randint(0, 64, (4, 3), generator=g)
    n_sup, slots = 4, model.num_attention_slots(4)
    # a threshold between the rows' scores at step 2 of their first fed token: some halt there, some go on
    scores = []
    for row, tokens in zip(rows, fed):
        states = [y[:, -1] for y, _ in model.refine(torch.tensor([row + tokens[:1].tolist()]), n_sup)]
        scores.append(rms_score(model, Draft(model, states[0]), Draft(model, states[1])).item())
    halting = Halting("rms", sum(sorted(scores)[1:3]) / 2)
    alone = []
    for row, tokens in zip(rows, fed):
        cache = KVCache(slots, 1, len(row) + fed.size(1))
        forward_halting(model, torch.tensor([row]), halting, cache, n_sup)
        alone.append([forward_halting(model, t.view(1, 1), halting, cache, n_sup) for t in tokens])
    narrowed = []
    narrow = RowCache.narrow
    monkeypatch.setattr(RowCache, "narrow", lambda self, rows: (narrowed.append(None if rows is None else len(rows)),
                                                                 narrow(self, rows)))
    idx, pads = left_pad(rows)
    prefill = KVCache(slots, len(rows), idx.size(1), pads)
    forward_halting(model, idx, halting, prefill, n_sup)
    cache = RowCache(slots)
    cache.join(prefill, idx.size(1) + fed.size(1))
    for t in range(fed.size(1)):
        logits, steps = forward_halting(model, fed[:, t:t + 1], halting, cache, n_sup)
        for b in range(len(rows)):
            torch.testing.assert_close(logits[b], alone[b][t][0][0], atol=ATOL, rtol=0)
            assert steps[b].item() == alone[b][t][1][0].item()
    assert sorted({alone[b][0][1].item() for b in range(len(rows))}) != [n_sup]  # some rows halted early
    assert any(n is not None and 0 < n < len(rows) for n in narrowed)  # and the others went on without them


def naive_greedy(model, row, max_tokens, n_sup):
    """Greedy decoding with a full uncached forward per token."""
    row = list(row)
    for _ in range(max_tokens):
        row.append(model(torch.tensor([row]), n_sup=n_sup)[0, -1].argmax().item())
    return row[-max_tokens:]


@torch.no_grad()
def test_engine_greedy_matches_uncached_greedy_for_rows_of_different_lengths():
    model = random_model(tiny_config(n_loops=1, T_recursion=2))
    engine = Engine(model)
    prompts = [[5], [1, 2, 3, 4, 5, 6, 7], list(range(10, 22))]
    for n_sup in (1, 4):
        got = engine.generate_batch(prompts, max_tokens=6, temperature=0.0, n_sup=n_sup)
        assert got == [naive_greedy(model, p, 6, n_sup) for p in prompts]
        assert got == engine.generate_batch(prompts, max_tokens=6, temperature=0.0, n_sup=n_sup)  # deterministic


@torch.no_grad()
def test_fewer_supervision_steps_give_that_steps_logits():
    """n_sup=s computes the first s steps of the full recursion: what --show_steps relies on."""
    model = random_model(tiny_config())
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    steps = [model.head(y) for y, _ in model.refine(idx, 4)]  # each step's logits of one 4-step recursion
    for s in range(1, 5):
        torch.testing.assert_close(cached_logits(model, idx, 3, s), steps[s - 1], atol=ATOL, rtol=0)
    assert (steps[0] - steps[-1]).abs().max() > 0.1  # the steps differ, so picking the wrong one would show


def test_seeded_sampling_is_reproducible():
    engine = Engine(random_model(tiny_config()))
    prompts = [[1, 2, 3], [4]]
    kwargs = dict(max_tokens=12, temperature=1.0, top_k=20)
    first = engine.generate_batch(prompts, seed=7, **kwargs)
    torch.manual_seed(123)  # the global RNG must not matter
    torch.rand(5)
    assert engine.generate_batch(prompts, seed=7, **kwargs) == first
    assert engine.generate_batch(prompts, seed=8, **kwargs) != first


def test_top_k_and_temperature():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]]).repeat(500, 1)
    rng = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, rng=rng).tolist()) == {1, 3}
    assert sample_next(logits, 1.0, top_k=1, rng=rng).unique().tolist() == [1]
    assert sample_next(logits, 0.0).unique().tolist() == [1]
    assert set(sample_next(logits, 1.0, rng=rng).tolist()) == {0, 1, 2, 3, 4}
    assert sample_next(logits, 0.01, rng=rng).unique().tolist() == [1]  # low temperature approaches greedy


def test_top_p_samples_the_nucleus_only():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    logits = probs.log().repeat(2000, 1)
    rng = torch.Generator().manual_seed(0)
    assert sample_next(logits, 1.0, top_p=0.45, rng=rng).unique().tolist() == [1]
    tokens = sample_next(logits, 1.0, top_p=0.7, rng=rng)
    assert tokens.unique().tolist() == [1, 3] and abs((tokens == 1).float().mean() - 0.5 / 0.8) < 0.05
    assert sample_next(logits, 1.0, top_p=0.9, rng=rng).unique().tolist() == [0, 1, 3]
    assert sample_next(logits, 1.0, top_p=1.0, rng=rng).unique().tolist() == [0, 1, 2, 3]
    assert sample_next(logits, 1.0, top_p=0.0, rng=rng).unique().tolist() == [1]  # the likeliest token always stays
    # top_k first, then top_p of what it kept: in the top 3, tokens 1 and 3 hold 0.8/0.95 = 0.84 > 0.82
    assert sample_next(logits, 1.0, top_p=0.82, rng=rng).unique().tolist() == [0, 1, 3]
    assert sample_next(logits, 1.0, top_k=3, top_p=0.82, rng=rng).unique().tolist() == [1, 3]


@pytest.mark.parametrize("temperature", [1e-30, 1e-45, 1e-308, 5e-324])
def test_tiny_temperatures_sample_the_argmax_without_nan(temperature):
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [2.0, 2.0, 1.0, -1.0, 0.0]]).repeat(200, 1)
    rng = torch.Generator().manual_seed(0)
    for top_k, top_p in [(None, None), (2, None), (None, 0.9)]:
        tokens = sample_next(logits, temperature, top_k=top_k, top_p=top_p, rng=rng)
        assert tokens[0::2].unique().tolist() == [1]
        assert tokens[1::2].unique().tolist() == [0, 1]  # a tie stays a fair choice between the tied tokens
    engine = Engine(random_model(tiny_config()))
    greedy = engine.generate_batch([[1, 2, 3]], max_tokens=5, temperature=0.0)
    assert engine.generate_batch([[1, 2, 3]], max_tokens=5, temperature=temperature, seed=0) == greedy


def test_generation_streams_and_stops():
    engine = Engine(random_model(tiny_config()))
    prompts = [[1, 2, 3], [9, 8]]
    greedy = engine.generate_batch(prompts, max_tokens=5, temperature=0.0)
    stream = engine.generate(prompts, max_tokens=5, temperature=0.0)
    assert next(stream) == [greedy[0][0], greedy[1][0]]  # one column per step, before the rest is computed
    stop = greedy[0][2]
    stopped = engine.generate_batch(prompts, max_tokens=5, temperature=0.0, stop_tokens={stop})
    assert stopped[0] == greedy[0][:greedy[0].index(stop)]
    assert stopped[1] == (greedy[1][:greedy[1].index(stop)] if stop in greedy[1] else greedy[1])
    assert [len(r) for r in engine.generate_batch(prompts, max_tokens=3, temperature=0.0)] == [3, 3]


@pytest.mark.parametrize("kwargs,message", [
    (dict(n_sup=0), "n_sup=0"), (dict(n_sup=5), "n_sup=5"), (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_k=0), "top_k"), (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=1000), "longest position"), (dict(prompts=[[1], []]), "at least one token"),
    (dict(prompts=[[64]]), "token ids"),
])
def test_bad_arguments_are_rejected_with_a_message(kwargs, message):
    engine = Engine(random_model(tiny_config()))
    kwargs = {"prompts": [[1, 2]], **kwargs}
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


@pytest.mark.parametrize("state_update", list(STATE_UPDATES))
@pytest.mark.parametrize("T_recursion", [1, 2])
@torch.no_grad()
def test_cached_decoding_matches_full_forward_for_every_state_update(state_update, T_recursion):
    config = tiny_config(n_loops=1, T_recursion=T_recursion, n_sup_train=3, state_update=state_update)
    model = random_model(config)
    idx = torch.randint(0, config.vocab_size, (2, config.sequence_len + 2), generator=torch.Generator().manual_seed(2))
    for n_sup in (1, 3):
        full = model(idx, n_sup=n_sup)
        assert full.std() > 0.3
        for prompt_len in (1, 5):
            cached = cached_logits(model, idx, prompt_len, n_sup)
            for t in range(prompt_len - 1, idx.size(1)):
                torch.testing.assert_close(cached[:, t], model(idx[:, :t + 1], n_sup=n_sup)[:, -1], atol=ATOL, rtol=0)


@torch.no_grad()
def test_under_bf16_autocast_the_cache_holds_keys_and_values_in_bf16_and_its_size_is_predicted():
    # float32 rotary tables used to promote q and k to float32 while v stayed bf16
    model = random_model(tiny_config(n_loops=1, n_sup_train=2))
    cache = KVCache(model.num_attention_slots(2), 2, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.zeros(2, 4, dtype=torch.long), kv_cache=cache, n_sup=2)
        per_token = kv_cache_bytes_per_token(model, 2)
    assert {t.dtype for t in cache.k + cache.v} == {torch.bfloat16}
    assert allocated(cache) == per_token * 2 * 6
    assert per_token == kv_cache_bytes_per_token(model, 2, dtype=torch.float32) // 2  # half of fp32's
    assert torch.isfinite(logits).all()


def cuda_autocast_rms_norm(monkeypatch):
    """F.rms_norm as CUDA's autocast runs it (on its float32 list; CPU's autocast leaves it alone): float32 out."""
    import torch.nn.functional as F
    plain = F.rms_norm
    def rms_norm(x, *args, **kwargs):
        return plain(x.float() if torch.is_autocast_enabled(x.device.type) else x, *args, **kwargs)
    monkeypatch.setattr(F, "rms_norm", rms_norm)


@torch.no_grad()
def test_under_cuda_autocast_rules_attention_and_the_cache_get_bf16_keys(monkeypatch):
    # QK-norm's float32 output used to reach attention as float32 q and k, and the cache stored float32 keys
    import torch.nn.functional as F
    cuda_autocast_rms_norm(monkeypatch)
    seen, sdpa = [], F.scaled_dot_product_attention
    def recording_sdpa(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    model = random_model(tiny_config(n_loops=1, n_sup_train=2))
    cache = KVCache(model.num_attention_slots(2), 2, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(2, 4, dtype=torch.long), n_sup=2)  # training's path, no cache
        model(torch.zeros(2, 4, dtype=torch.long), kv_cache=cache, n_sup=2)
        model(torch.zeros(2, 1, dtype=torch.long), kv_cache=cache, n_sup=2)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    assert {t.dtype for t in cache.k + cache.v} == {torch.bfloat16}


def test_the_engines_autocast_holds_on_the_thread_that_runs_the_generation():
    # the server iterates a generation on worker threads, where a caller's `with autocast` (per thread) does not reach
    model = random_model(tiny_config(n_loops=1, n_sup_train=2))
    caches = []
    real_new_cache = Engine.new_cache

    def new_cache(self, *args, **kwargs):
        caches.append(real_new_cache(self, *args, **kwargs))
        return caches[-1]

    engine = Engine(model, autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    engine.new_cache = new_cache.__get__(engine)
    tokens = engine.generate([[1, 2, 3]], max_tokens=3, temperature=0, stop_tokens=())
    worker = threading.Thread(target=lambda: list(tokens))
    worker.start()
    worker.join(timeout=60)
    assert {t.dtype for t in caches[0].k + caches[0].v} == {torch.bfloat16}
    plain = Engine(model).generate_batch([[1, 2, 3]], max_tokens=3, temperature=0, stop_tokens=())
    assert len(plain[0]) == 3


@torch.no_grad()
def test_cache_bytes_per_token_is_what_the_cache_allocates():
    config = tiny_config(n_loops=2, T_recursion=2, n_kv_head=2)
    model = random_model(config)
    cache = KVCache(model.num_attention_slots(3), 2, 10)
    model(torch.zeros(2, 4, dtype=torch.long), kv_cache=cache, n_sup=3)
    assert all(k is not None for k in cache.k)  # every slot was used
    assert allocated(cache) == kv_cache_bytes_per_token(model, 3) * 2 * 10
    assert kv_cache_bytes_per_token(model, 3) == 2 * (3 * 2 * 2 * 3) * 2 * 8 * 4  # k+v, slots, kv heads, dim, fp32


# ---------------------------------------------------------------- the sampling CLI on a tiny trained checkpoint

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


def test_engine_complete_and_generate_stream_the_same_text(trained):
    _, model, tokenizer = trained
    engine = Engine(model, tokenizer)
    completions = engine.complete(["the cat sat", "the"], max_tokens=12, temperature=0.0)
    assert completions[0].startswith(" on the")  # the tiny model learned its text
    columns = list(engine.generate([engine.encode_prompt("the cat sat")], max_tokens=12, temperature=0.0))
    assert len(columns) > 1 and tokenizer.decode([c[0] for c in columns if c[0] is not None]) == completions[0]


def test_a_character_split_across_tokens_is_seen_as_incomplete_until_its_last_token(trained):
    _, _, tokenizer = trained
    ids = tokenizer.encode("\u20ac")  # the euro sign: three UTF-8 bytes, which the tiny tokenizer never merged
    assert len(ids) == 3
    assert [ends_mid_character(tokenizer.decode(ids[:k])) for k in (1, 2, 3)] == [True, True, False]


def test_sample_cli_show_steps_lists_every_step(trained, monkeypatch, capsys):
    base_dir, model, _ = trained
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    argv = ["--model_tag", MODEL_TAG, "--step", "best", "--prompt", "the cat", "--prompt", "the dog sat",
            "--max_tokens", "8", "--show_steps", "--device_type", "cpu"]
    assert base_sample.main(argv) == 0
    out = capsys.readouterr().out
    n_sup = model.config.n_sup_inference
    assert "model step 20:" in out  # best, not latest
    assert f"{kv_cache_bytes_per_token(model, n_sup):,} bytes/token" in out
    for prompt in ("the cat", "the dog sat"):
        section = out.split(f"--- {prompt!r}")[1].split("---")[0]
        for s in range(1, n_sup + 1):
            assert f"step {s}/{n_sup} (greedy): " in section
    assert "prefill: " in out and "decode: " in out and "tok/s" in out


def test_sample_cli_reads_prompts_file_and_reports_bad_input(trained, monkeypatch, capsys, tmp_path):
    base_dir, _, _ = trained
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the log\n\nthe mat\n")
    assert base_sample.main(["--model_tag", MODEL_TAG, "--prompts_file", str(prompts), "--max_tokens", "4",
                             "--n_sup", "1", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "--- 'the log'" in out and "--- 'the mat'" in out and "n_sup=1" in out
    assert base_sample.main(["--model_tag", MODEL_TAG, "--step", "7"]) == 2
    assert "no checkpoint at step 7" in capsys.readouterr().err
    assert base_sample.main(["--model_tag", MODEL_TAG, "--n_sup", "9", "--prompt", "the"]) == 2
    assert "n_sup=9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        base_sample.main(["--temperature", "-1"])
    assert "--temperature=-1.0: must be >= 0" in capsys.readouterr().err


def test_sample_cli_with_halting_shows_each_tokens_steps(trained, monkeypatch, capsys):
    base_dir, model, tokenizer = trained
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    argv = ["--model_tag", MODEL_TAG, "--prompt", "the cat", "--max_tokens", "5", "--temperature", "0",
            "--device_type", "cpu"]
    assert base_sample.main(argv + ["--halt", "rms:inf", "--show_steps"]) == 0
    out = capsys.readouterr().out
    # an infinite threshold halts every token after step 1: step 1's greedy tokens, each shown with 1 step
    engine = Engine(model, tokenizer)
    step_one = engine.generate_batch([engine.encode_prompt("the cat")], max_tokens=5, temperature=0.0, n_sup=1)[0]
    assert f"the cat{tokenizer.decode(step_one)}\n" in out
    shown = out.split("steps per token: ")[1].splitlines()[0]
    assert shown == " ".join(f"{tokenizer.decode([t])!r}:1" for t in step_one)
    assert f"halting rms:inf: mean 1.00 of {model.config.n_sup_inference} supervision steps" in out
    with pytest.raises(SystemExit):
        base_sample.main(argv + ["--halt", "kl"])
    assert "--halt: halting rule 'kl': write RULE:THRESHOLD" in capsys.readouterr().err


def alone_and_together(engine, specs, **shared):
    """Each spec's columns generated alone, and the same requests generated together in one batch."""
    alone = [list(engine.generate(**spec, **shared)) for spec in specs]
    together = list(engine.generate_together([engine.prepare(**spec, **shared) for spec in specs]))
    return alone, [[columns[i] for columns in together][:len(alone[i])] for i in range(len(specs))], together


def test_requests_generated_together_get_what_they_get_alone(trained):
    """Greedy rows token for token, and seeded sampling (each request its own generator) draw for draw."""
    _, model, tokenizer = trained
    engine = Engine(model, tokenizer)
    encode = engine.encode_prompt
    specs = [dict(prompts=[encode("the cat sat")], max_tokens=12, temperature=0.0),
             dict(prompts=[encode("the"), encode("the dog sat on the")], max_tokens=5, temperature=0.0),
             dict(prompts=[encode("the mat")] * 3, max_tokens=9, temperature=1.0, seed=7, top_k=5),
             dict(prompts=[encode("on the log. the")], max_tokens=7, temperature=0.8, seed=3, top_p=0.9),
             dict(prompts=[encode("the cat")], max_tokens=0, temperature=0.0)]
    alone, together, columns = alone_and_together(engine, specs)
    assert together == alone and len(columns) == 12
    assert all(c[1] == [None, None] for c in columns[5:]) and all(c[4] == [None] for c in columns)  # past max_tokens
    assert any(t is not None for c in alone[2] for t in c)
    halting, _, _ = alone_and_together(engine, specs[:2], n_sup=3, halt="rms:0.05")
    assert halting[0] and halting[1]
    _, together_halting, _ = alone_and_together(engine, specs[:2], n_sup=3, halt="rms:0.05")
    assert together_halting == halting
    with pytest.raises(ValueError, match="must share n_sup and halting"):
        engine.generate_together([engine.prepare(**specs[0], n_sup=1), engine.prepare(**specs[1], n_sup=2)])


def run_staggered(engine, specs, joins, **shared):
    """Each spec's request added to one Batch at step joins[i]; every member's columns until it finishes, and the
    rows the batch held at each step (after that step's joins and leaves)."""
    batch = Batch(engine, engine.check_n_sup(shared.get("n_sup")), engine.check_halt(shared.get("halt")))
    members, columns, rows = [None] * len(specs), [[] for _ in specs], []
    for step in range(100):
        for i, spec in enumerate(specs):
            if joins[i] == step:
                members[i] = batch.add(engine.prepare(**spec, **shared))
        if step > max(joins) and not batch:
            break
        for member, column in batch.step():
            columns[members.index(member)].append(column)
        rows.append(batch.rows)
    return columns, rows


def test_requests_joining_and_leaving_a_running_batch_get_what_they_get_alone(trained):
    """Requests join a running batch at later tokens and leave it when done (the last rows move into theirs): each
    gets, token for token (greedy) and draw for draw (seeded), what it gets alone, with halting too."""
    _, model, tokenizer = trained
    engine = Engine(model, tokenizer)
    encode = engine.encode_prompt
    specs = [dict(prompts=[encode("the cat sat")], max_tokens=4, temperature=0.0),
             dict(prompts=[encode("the"), encode("the dog sat on the")], max_tokens=10, temperature=0.0),
             dict(prompts=[encode("the mat")] * 2, max_tokens=9, temperature=1.0, seed=7, top_k=5),
             dict(prompts=[encode("on the log. the")], max_tokens=7, temperature=0.0),
             dict(prompts=[encode("the cat")], max_tokens=0, temperature=0.0)]
    joins = [0, 1, 2, 5, 5]
    for shared in ({}, dict(n_sup=3, halt="rms:0.05")):
        alone = [list(engine.generate(**spec, **shared)) for spec in specs]
        together, rows = run_staggered(engine, specs, joins, **shared)
        assert together == alone
        # the first request leaves after its 4th token (step 3), the next two move up; the fourth joins at step 5
        assert rows[:6] == [1, 3, 5, 4, 4, 5]
    assert len({tuple(t for c in columns for t in c) for columns in alone[:4]}) == 4
    assert any(t is not None for c in alone[2] for t in c) and alone[4] == []


def test_requests_of_fewer_steps_ride_a_deeper_batch_and_get_what_they_get_alone(trained):
    """A batch of 3 steps takes, at later tokens, requests of 1 and 2 steps (greedy and seeded): each gets what it
    gets alone at its own depth; a deeper request, or one that halts, cannot join it."""
    _, model, tokenizer = trained
    engine = Engine(model, tokenizer)
    engine.most_steps = 4  # past the trained 3, as the server allows
    encode = engine.encode_prompt
    specs = [dict(prompts=[encode("the cat sat")], max_tokens=6, temperature=0.0, n_sup=3),
             dict(prompts=[encode("x"), encode("the dog sat on the")], max_tokens=8, temperature=0.0, n_sup=1),
             dict(prompts=[encode("the mat")] * 2, max_tokens=5, temperature=1.0, seed=7, top_k=5, n_sup=2),
             dict(prompts=[encode("on the log. the")], max_tokens=7, temperature=0.0, n_sup=2)]
    alone = [list(engine.generate(**spec)) for spec in specs]
    batch, members, together = Batch(engine, 3, None), {}, [[] for _ in specs]
    joins = {0: 0, 1: 1, 2: 1, 3: 4}
    for step in range(30):
        for i in [i for i, at in joins.items() if at == step]:
            members[i] = batch.add(engine.prepare(**specs[i]))
        for member, column in batch.step():
            together[[i for i, m in members.items() if m is member][0]].append(column)
        if step > 4 and not batch:
            break
    assert together == alone
    # the depth changes the text: each row answered from its own step, not the batch's
    assert list(engine.generate(**{**specs[1], "n_sup": 3})) != alone[1]
    for deeper in (dict(n_sup=4), dict(n_sup=3, halt="rms:0.05"), dict(n_sup=2, halt="rms:0.05")):
        request = engine.prepare([encode("the")], max_tokens=2, **deeper)
        assert not batch.admits(request)
        with pytest.raises(ValueError, match="cannot join a batch of n_sup 3"):
            batch.add(request)
