"""meta.json's rules as plain functions: retention's choice, the best step, the shape and size checks."""

import pytest

from nanochat.checkpoint.meta import CONFIG_LIMITS, best_of, final_val_bpb, meta_problem, steps_to_prune
from nanochat.model.gpt import GPTConfig


def test_retention_keeps_the_newest_k_and_the_best_and_never_prunes_with_k_zero():
    bpb = {100: 2.0, 200: 1.5, 300: None, 400: 1.9, 500: 1.7}
    assert best_of(bpb) == 200
    assert steps_to_prune(bpb, 2) == [100, 300]   # 400 and 500 are the newest, 200 the best
    assert steps_to_prune(bpb, 1) == [100, 300, 400]
    assert steps_to_prune(bpb, 0) == []           # 0 keeps all
    assert steps_to_prune({7: None, 8: None}, 1) == [7]  # nothing scored: only the newest stays
    assert best_of({7: None}) is None


def test_the_final_supervision_steps_bpb_is_what_counts():
    assert final_val_bpb({"val_bpb": [2.0, 1.8, 1.7]}) == 1.7
    assert final_val_bpb({"val_bpb": None}) is None and final_val_bpb({}) is None


def meta(**changes):
    config = GPTConfig(sequence_len=64, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    return {"step": 10, "model_config": {**vars(config), **changes.pop("config", {})}, "elapsed_seconds": 1.0,
            **changes}


def test_a_well_formed_meta_passes_and_each_bad_field_is_named():
    assert meta_problem(meta()) is None
    assert "step" in meta_problem(meta(step=True))  # a bool is not a step
    assert "elapsed_seconds" in meta_problem(meta(elapsed_seconds=float("nan")))
    assert "early_stop lacks" in meta_problem(meta(early_stop={"stale": 1}))
    assert "model_config is missing" in meta_problem({"step": 1})


@pytest.mark.parametrize("field", sorted(CONFIG_LIMITS))
def test_sizes_no_weight_shape_bounds_are_capped(field):
    big = CONFIG_LIMITS[field] + 1
    config = {field: big}
    if field in ("n_head", "n_kv_head"):  # a config of consistent heads, so only the cap can refuse it
        config = {"n_head": big, "n_kv_head": big, "n_embd": 2 * big}
    problem = meta_problem(meta(config=config))
    named = "n_head" if field == "n_kv_head" else field  # n_kv_head <= n_head: the larger is refused first
    assert f"model_config.{named}={big} exceeds" in problem, problem
