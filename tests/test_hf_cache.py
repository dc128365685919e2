"""The exported model's KV cache: one transformers Cache layer per attention slot of the recursion, computing the
logits and the greedy text of the uncached forward."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from nanochat.model.gpt import STATE_UPDATES, GPTConfig
from scripts import export_hf
from tests.support.helpers import random_model
from tests.support.tiny_checkpoint import tiny_checkpoint

ATOL = 1e-4
# the recursion's shapes that change the slot layout: loops per visit, sweeps per step, and the state update rules
SHAPES = [dict(n_loops=0), dict(n_loops=1), dict(n_loops=2, T_recursion=2),
          *[dict(n_loops=1, T_recursion=2, state_update=update) for update in STATE_UPDATES if update != "residual"],
          dict(n_loops=1, n_prelude=1, n_coda=2)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)[2]


def exported(tokenizer, directory, **options):
    """A random-weight model (every logit depends on every slot) exported and loaded back through transformers."""
    config = GPTConfig(sequence_len=16, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2,
                       n_embd=32, n_sup_train=3, **options)
    model = random_model(config, every_weight=True)
    meta = {"step": 1, "model_config": config.to_dict(), "val_bpb": None}
    export_hf.write_export(model, tokenizer, meta, "random", str(directory))
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


def returned_cache(output):
    """The cache a model output or generate result holds: `cache` from transformers 5.24, `past_key_values` before."""
    return getattr(output, "cache" if "cache" in output.__dataclass_fields__ else "past_key_values")


def count_forward_tokens(hf):
    """A list that receives, at every forward of the wrapped GPT, the number of positions it was given."""
    seen, forward = [], hf.model.forward

    def counting(idx, *args, **kwargs):
        seen.append(idx.size(1))
        return forward(idx, *args, **kwargs)

    hf.model.forward = counting
    return seen


@pytest.mark.parametrize("options", SHAPES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@torch.no_grad()
def test_cached_logits_equal_the_full_forward_at_every_position_and_step(options, tokenizer, tmp_path):
    hf = exported(tokenizer, tmp_path / "out", **options)
    idx = torch.randint(0, hf.config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(0))
    for n_sup in range(1, hf.config.n_sup_inference + 1):
        full = hf(input_ids=idx, n_sup=n_sup).logits
        assert full.std() > 0.3  # random weights: a wrong slot cannot match by accident
        cache = DynamicCache()
        spans = [(0, 6), (6, 7), (7, 8), (8, 12), (12, 13), (13, 14)]  # a prefill, then 1 and 4 tokens at a time
        # both keywords transformers has used for the cache: `cache` (5.24+) and `past_key_values` (before)
        pieces = [hf(input_ids=idx[:, a:b], n_sup=n_sup, **{("cache", "past_key_values")[i % 2]: cache}).logits
                  for i, (a, b) in enumerate(spans)]
        assert len(cache.layers) == hf.model.num_attention_slots(n_sup) and cache.get_seq_length() == 14
        assert (torch.cat(pieces, dim=1) - full).abs().max() <= ATOL, f"n_sup={n_sup}"


@pytest.mark.parametrize("options", SHAPES[:3], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@torch.no_grad()
def test_cached_generate_equals_uncached_generate(options, tokenizer, tmp_path):
    hf = exported(tokenizer, tmp_path / "out", **options)
    prompt = torch.randint(0, hf.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    for n_sup in (1, hf.config.n_sup_inference):
        kwargs = dict(max_new_tokens=10, do_sample=False, n_sup=n_sup, eos_token_id=None,
                      return_dict_in_generate=True)
        seen = count_forward_tokens(hf)
        cached = hf.generate(prompt, use_cache=True, **kwargs)
        assert seen == [5] + [1] * 9  # the prompt once, then one new token per forward: the cache was read
        seen.clear()
        uncached = hf.generate(prompt, use_cache=False, **kwargs)
        assert seen == list(range(5, 15))  # without it, the whole sequence every time
        del hf.model.forward
        assert cached.sequences.shape == (2, 15) and torch.equal(cached.sequences, uncached.sequences)
        assert len(returned_cache(cached).layers) == hf.model.num_attention_slots(n_sup)  # the cache was written
        assert returned_cache(uncached) is None


@torch.no_grad()
def test_the_export_generates_with_a_cache_by_default(tokenizer, tmp_path):
    hf = exported(tokenizer, tmp_path / "out", n_loops=1)
    out = hf.generate(torch.tensor([[tokenizer.get_bos_token_id(), 5, 6]]), max_new_tokens=4, do_sample=False,
                      eos_token_id=None, return_dict_in_generate=True)
    assert returned_cache(out).get_seq_length() == 3 + 4 - 1  # the last token is returned, never fed back
