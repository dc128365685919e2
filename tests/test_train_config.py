"""nanochat/train_config and nanochat/planning: the compute-optimal batch and its learning-rate scaling, the automatic
device batch shared with the launcher, and --dry_run."""

import math
import os
import re

import pytest
import torch

from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train import config as train_config
from nanochat.train import memory, planning
from nanochat.train.flops import estimate_flops

GPU_80GB = ["--device_type=cuda", "--device_memory_gb=80", "--dry_run"]  # a plan for a GPU this machine lacks


def parse(argv, world_size=8):
    return train_config.parse_args(argv, world_size=world_size, check_hardware=False, vocab_size=65536)


# Worked by hand from the rule (nanochat HEAD): parameters of depth d at width 64d and vocab 65,536 are
# 12 * d * (64d)^2 + 2 * 64d * 65,536; d12 = 185.6M, d24 = 880.8M; 2^19 * (880.8 / 185.6)^0.383 = 952k -> 2^20.
@pytest.mark.parametrize("depth, batch, lr_scale", [(12, 524288, 1.0), (24, 1048576, math.sqrt(2))])
def test_auto_batch_and_lr_scaling_follow_the_documented_values(depth, batch, lr_scale):
    run_config = parse([f"--depth={depth}", *GPU_80GB])
    assert run_config.total_batch_size == batch
    assert run_config.lr_scale == pytest.approx(lr_scale)
    assert any("compute-optimal" in note for note in run_config.batch_notes)


def test_an_explicit_total_batch_disables_the_auto_batch_and_the_lr_scaling():
    run_config = parse(["--depth=24", "--total_batch_size=524288", *GPU_80GB])
    assert run_config.total_batch_size == 524288 and run_config.lr_scale == 1.0
    run_config = parse(["--depth=24", "--device_batch_size=4", "--gradient_accumulation_steps=2", *GPU_80GB])
    assert run_config.total_batch_size == 8 * 4 * 2048 * 2 and run_config.lr_scale == 1.0


def test_auto_device_batch_for_depth_12_on_8x80gb_fits_with_the_launchers_margin():
    run_config = parse(["--depth=12", *GPU_80GB])
    est = memory.estimate_memory(planning.model_config(run_config, 65536), run_config.device_batch_size, "bfloat16", 8,
                                 planning.keeps_ema(run_config.ema_decay, run_config.num_iterations))["total"]
    assert est <= memory.usable_bytes(80e9)
    bigger = run_config.device_batch_size * 2  # the next candidate of the 32 sequences per process does not fit
    assert memory.estimate_memory(planning.model_config(run_config, 65536), bigger, "bfloat16", 8,
                                  planning.keeps_ema(run_config.ema_decay, run_config.num_iterations))["total"] \
        > memory.usable_bytes(80e9)
    assert run_config.compile is True  # on by default for CUDA
    assert (run_config.world_size * run_config.device_batch_size * run_config.max_seq_len * run_config.grad_accum
            == run_config.total_batch_size)


def test_the_launcher_and_base_train_choose_the_same_device_batch(monkeypatch):
    from scripts import launch
    direct = parse(["--depth=12", *GPU_80GB])
    # the launcher's 8xH100 fast row, 80 GB per GPU: its fit goes through planning.fit_device_batch too
    _, run_config, _ = launch.compose("8xH100", "fast", ["--device_type=cuda"], 65536, int(80e9))
    assert run_config.device_batch_size == direct.device_batch_size


def test_compile_is_off_by_default_on_cpu_and_the_flag_wins():
    assert parse(["--depth=2", "--device_type=cpu"], world_size=1).compile is False
    assert parse(["--depth=2", "--device_type=cpu", "--compile"], world_size=1).compile is True


def test_the_row_layout_reaches_every_training_loader(tmp_path, monkeypatch):
    from nanochat.data import dataloader
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path))  # no corpus: auto is the stream
    made = []
    monkeypatch.setattr(dataloader, "DataLoader", lambda *args, **kwargs: made.append(kwargs["rows"]))
    for flags, rows in (([], "stream"), (["--rows=documents"], "documents"), (["--rows=auto"], "stream")):
        run_config = parse(["--depth=2", "--device_type=cpu", "--device_batch_size=2", "--total_batch_size=8192",
                            *flags], world_size=1)
        made.clear()
        dataloader.training_loaders(run_config, None, 0, [None] * run_config.grad_accum)
        assert made == [rows] * run_config.grad_accum and run_config.grad_accum > 1


def test_auto_rows_are_whole_documents_on_a_generated_corpus_and_the_stream_on_text(tmp_path, monkeypatch):
    from nanochat.data.dataset import write_source
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path))
    settle = lambda *flags: parse(["--depth=2", "--device_type=cpu", *flags], world_size=1).rows  # noqa: E731
    samples = lambda: parse(["--depth=2", "--device_type=cpu"], world_size=1).samples  # noqa: E731
    assert settle() == "stream" and samples()  # no corpus yet
    write_source(str(tmp_path), "synthetic: --synthetic=hops_pairs --seed=0 --hops_symbols=8")
    assert settle() == "documents" and settle("--rows=stream") == "stream"
    assert not samples()  # English prompts on a hops corpus mean nothing
    write_source(str(tmp_path), "builtin: the Python standard library")
    assert settle() == "stream" and settle("--rows=documents") == "documents" and samples()
    (tmp_path / "manifest.json").write_text("{not json")  # whatever the manifest's name, a damaged one is text
    for name in os.listdir(tmp_path):
        (tmp_path / name).write_text("{not json")
    assert settle() == "stream"


def test_accumulation_past_64_warns_and_names_the_flag():
    run_config = parse(["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--device_type=cpu"], world_size=1)
    assert run_config.grad_accum > planning.QUIET_ACCUMULATION
    assert any("WARNING" in note and "--total_batch_size" in note for note in run_config.batch_notes)


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, monkeypatch, capsys):
    # base_train's main in process (a process costs seconds of imports; `python -m scripts.base_train` reaching main is
    # test_base_train's, which runs it)
    from scripts import base_train
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    base_train.main(["--depth=12", *GPU_80GB, "--peak_tflops=989", "--gpu_hourly_price=2"])
    out = capsys.readouterr().out
    for heading in ("processes", "batch", "memory", "compute", "time"):
        assert any(line.startswith(heading) for line in out.splitlines()), heading
    assert "device batch" in out and "s per step" in out and "$" in out
    assert out.rstrip().endswith("--dry_run: nothing was run or written")
    assert not base.exists()


@pytest.mark.parametrize("flag, message", [
    ("--early_stop=-1", "--early_stop=-1 must be >= 0"),
    # the evaluation is cut into rows of --max_seq_len, whatever the number of processes
    ("--eval_tokens=31", "--eval_tokens=31 is less than one validation row (--max_seq_len=32 tokens); raise it"),
])
def test_early_stop_and_eval_tokens_are_checked(flag, message, capsys):
    shape = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2"]
    with pytest.raises(SystemExit) as e:
        parse([*shape, flag])
    assert e.value.code != 0 and message in capsys.readouterr().err + str(e.value.code)
    assert parse([*shape, "--eval_tokens=32"]).eval_tokens == 32  # one row: enough on 8 processes too


def test_auto_sharding_is_fsdp_only_when_data_parallelism_cannot_hold_one_sequence():
    # depth 64 at width 4096: 13.4 B parameters, ~214 GB per GPU replicated even at one checkpointed sequence (the
    # head's chunk: 2,048 rows of 4,096 since HEAD_CHUNK_ELEMENTS = 2**28, compiled: 10 bytes a logit; the inputs of 4
    # supervision steps' layer visits kept, as the default backpropagates through 4)
    big = parse(["--depth=64", "--n_loops=2", "--activation_checkpointing", *GPU_80GB])
    assert big.sharding == "fsdp" and "sharding fsdp (auto)" in big.sharding_note and "214.3 GB" in big.sharding_note
    est = memory.estimate_memory(planning.model_config(big, 65536), big.device_batch_size, "bfloat16", 8,
                                 planning.keeps_ema(big.ema_decay, big.num_iterations), "fsdp")["total"]
    assert est <= memory.usable_bytes(80e9)  # the batch was fitted to the sharded estimate
    small = parse(["--depth=24", "--n_embd=1536", "--n_head=24", *GPU_80GB])  # the 1B guide's shape: replicated fits
    assert small.sharding == "ddp" and "cheaper in communication" in small.sharding_note
    assert parse(["--depth=64", "--n_loops=2", "--sharding=ddp", "--device_batch_size=1", *GPU_80GB]).sharding == "ddp"
    assert parse(["--depth=2", "--device_type=cpu", "--sharding=fsdp"], world_size=1).sharding == "fsdp"
    assert parse(["--depth=2", "--device_type=cpu"], world_size=1).sharding == "ddp"  # one process: nothing to shard


def test_fsdp_outside_torchrun_is_refused_in_one_line():
    with pytest.raises(SystemExit, match="--sharding=fsdp needs a process group: launch with torchrun"):
        train_config.parse_args(["--depth=2", "--device_type=cpu", "--sharding=fsdp"], world_size=1)


def test_fsdp_is_refused_early_when_host_ram_cannot_hold_the_weight_every_rank_draws_whole(monkeypatch):
    # every rank draws each float32 weight whole on the CPU to keep its rows: 8 ranks of depth 64 need 8 lm_heads of
    # 65536 x 4096 (~8.6 GB of RAM; ~430 GB when each built the whole model)
    monkeypatch.setattr(train_config, "get_dist_info", lambda: (True, 0, 0, 8))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    flags = ["--depth=64", "--n_loops=2", "--activation_checkpointing", "--sharding=fsdp", "--device_type=cpu",
             "--device_memory_gb=80"]  # not a dry run: the check runs where the ranks would build
    need = memory.sharded_build_host_bytes(planning.model_config(parse(flags), 65536), 8)
    assert need == 8 * 4 * 65536 * 4096
    monkeypatch.setattr(planning, "host_ram_available", lambda: need - 1)
    with pytest.raises(SystemExit, match="each of the 8 processes on this node draws the model.s largest float32"):
        train_config.parse_args(flags, world_size=8, vocab_size=65536)
    monkeypatch.setattr(planning, "host_ram_available", lambda: need)
    assert train_config.parse_args(flags, world_size=8, vocab_size=65536).sharding == "fsdp"
    line = next(line for line in planning.plan_lines(parse(flags)) if line.startswith("  fsdp"))
    assert f"needs ~{need / 8 / 1e9:.1f} GB host RAM per process" in line


def test_the_plan_prints_the_sharding_both_choices_and_the_budget_in_steps():
    run_config = parse(["--depth=64", "--n_loops=2", "--activation_checkpointing", "--max_hours=31",
                        "--peak_tflops=989", "--num_iterations=1000", *GPU_80GB])
    lines = planning.plan_lines(run_config)
    assert any(line.startswith("sharding     fsdp (auto)") for line in lines)
    assert any("ddp: ~" in line and "does NOT fit" in line for line in lines)
    assert any("fsdp (chosen): ~" in line and "parameter all-gathers per micro-step" in line for line in lines)
    assert any(line.startswith("budget       --max_hours=31: ~") and "of 1,000 steps" in line for line in lines)
    assert any("13,421,772,800 parameters" in line for line in lines)


def test_the_plan_states_the_evaluations_share_of_the_run():
    run_config = train_config.parse_args(["--depth=2", "--num_iterations=1000", "--eval_every=250",
                                          "--eval_tokens=5242880", "--device_batch_size=4", "--max_seq_len=64"],
                                         world_size=1, check_hardware=False, vocab_size=256)
    assert planning.evaluations(run_config.eval_every, 1000) == 5  # steps 0, 250, 500, 750, 1000
    assert planning.evaluations(run_config.eval_every, 1001) == 6  # ... and the end
    with torch.device("meta"):
        model = GPT(GPTConfig(**{**run_config.model_config, "vocab_size": 256}))
    forward, train = estimate_flops(model, backward=False), estimate_flops(model)
    line = planning.evaluation_line(run_config, model, 1000, train * run_config.total_batch_size)
    share = 5 * 5242880 * forward / (5 * 5242880 * forward + 1000 * train * run_config.total_batch_size)
    assert line.startswith("evaluation   5 evals x 5,242,880 tokens") and f"{share:.1%} of the run's compute" in line
    assert any(l.startswith("evaluation   ") for l in planning.plan_lines(run_config))


def test_state_dtype_reaches_the_model_config_and_the_plan_and_needs_autocast():
    fp32, bf16 = (parse(GPU_80GB + ["--depth=12", f"--state_dtype={d}"], world_size=1) for d in ("float32", "bfloat16"))
    assert bf16.model_config["state_dtype"] == "bfloat16" and bf16.config_sources["state_dtype"] == "flag"
    assert parse(GPU_80GB + ["--depth=12"], world_size=1).model_config["state_dtype"] == "float32"
    assert bf16.device_batch_size >= fp32.device_batch_size  # the planner counts the smaller state
    with pytest.raises(SystemExit, match="--state_dtype=bfloat16 needs autocast: add --dtype=bfloat16"):
        parse(["--depth=2", "--device_type=cpu", "--dtype=float32", "--state_dtype=bfloat16", "--dry_run"], 1)


def test_the_plan_sets_the_heads_chunks_from_memory_and_the_compile_scope_from_the_model():
    # a plain depth-12 GPT at 32 x 2048 (the kit's step): compiled, 2 chunks fit 80 GB by the estimate and 1 fits
    # 141 GB; without compilation the eager chunk holds more bytes a logit; --head_chunks and --compile_scope win
    plain = ["--depth=12", "--n_loops=0", "--n_sup_train=1", "--device_batch_size=32", "--device_type=cuda",
             "--dry_run"]
    h100 = parse([*plain, "--device_memory_gb=80"], world_size=1)
    assert h100.head_chunks == 2 and h100.compile_scope == "model"
    assert "training head: 2 chunks of 32,768 rows" in "\n".join(h100.batch_notes)
    assert parse([*plain, "--device_memory_gb=141"], world_size=1).head_chunks == 1
    assert parse([*plain, "--device_memory_gb=100"], world_size=1).head_chunks == 1
    assert parse([*plain, "--device_memory_gb=100", "--compile=false"], world_size=1).head_chunks == 2
    assert parse([*plain, "--device_memory_gb=40"], world_size=1).head_chunks is None  # the default chunk
    assert parse([*plain, "--device_memory_gb=80", "--head_chunks=16"], world_size=1).head_chunks == 16
    trm = parse(["--depth=12", *GPU_80GB])
    assert trm.compile_scope == "layer"
    assert parse(["--depth=12", "--compile_scope=model", *GPU_80GB]).compile_scope == "model"
    lines = "\n".join(planning.plan_lines(h100))
    assert "compile True (scope model)" in lines
    need = memory.estimate_memory(planning.model_config(h100, 65536), 32, "bfloat16", 1, True, "ddp", 2, True)
    assert f"~{need['total'] / 1e9:.1f} GB per device" in lines  # the plan counts the head it planned (EMA auto)


@pytest.mark.parametrize("flags, message", [
    (["--compile_scope=model", "--sharding=fsdp"], "--compile_scope: compile scope model compiles whole sweeps"),
    (["--head_chunks=0"], "--head_chunks=0 must be >= 1"),
    (["--diagnostics_every=0"], "--diagnostics_every=0 must be >= 1"),
])
def test_a_bad_compile_scope_head_or_diagnostics_flag_is_one_line(flags, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse(["--depth=2", "--n_loops=0", *flags, *GPU_80GB])


def test_a_resumed_run_keeps_the_recipe_it_was_trained_with_whatever_the_defaults_are_now():
    # a run saved before issue 57's default (the one-step detach at a fixed depth, no curriculum recorded; the two
    # recipe fields absent from its config, as in checkpoints that predate them) resumes as it was trained
    old = {"step": 40, "model_config": {"sequence_len": 32, "vocab_size": 64, "n_layer": 1, "n_head": 2, "n_kv_head": 2,
                                        "n_embd": 32}, "train_config": {}}
    shape = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_type=cpu",
             "--device_batch_size=2"]
    asked = []
    resumed = lambda tag, step: asked.append((tag, step)) or old  # noqa: E731

    def parse_resumed(*flags):
        return train_config.parse_args([*shape, *flags], world_size=1, check_hardware=False, vocab_size=64,
                                       resumed_meta=resumed)

    run = parse_resumed("--resume", "--model_tag=old")
    assert asked == [("old", None)]
    assert (run.model_config["sample_n_sup"], run.model_config["backprop_steps"], run.n_sup_warmup) == (False, 1, 0.0)
    assert run.config_sources["backprop_steps"] == "checkpoint step 40"
    # a flag still wins over the checkpoint, and --resume_from_step asks for its own step
    run = parse_resumed("--resume_from_step=20", "--model_tag=old", "--backprop_steps=2", "--n_sup_warmup=0.3")
    assert asked[-1] == ("old", 20)
    assert (run.model_config["backprop_steps"], run.config_sources["backprop_steps"], run.n_sup_warmup) == \
        (2, "flag", 0.3)
    assert run.model_config["sample_n_sup"] is False
    # a fresh run takes today's defaults and reads no checkpoint
    run = parse_resumed("--model_tag=new")
    assert len(asked) == 2
    assert (run.model_config["sample_n_sup"], run.model_config["backprop_steps"], run.n_sup_warmup) == \
        ("lognormal_poisson", 4, 0.5)


def test_the_plan_prints_its_recompute_or_accumulate_choice_and_why(monkeypatch):
    # issue 57's recipe keeps 4 supervision steps' activations alive: on 80 GB the batch of 32 does not fit as it is;
    # the plan times 4 rows with more accumulation against recomputing every layer visit at 32, and says so
    recipe = ["--depth=12", "--sample_n_sup=lognormal_poisson", "--backprop_steps=4", "--n_sup_warmup=0.5",
              "--total_batch_size=524288", *GPU_80GB]
    run_config = parse(recipe)
    note = next(n for n in run_config.batch_notes if n.startswith("device batch"))
    assert (run_config.device_batch_size, run_config.grad_accum) == (4, 8)
    assert not run_config.model_config["activation_checkpointing"]
    assert "accumulate: batch 4 with more accumulation (8,192-token micro-batches at 81%" in note
    assert "against activation checkpointing at batch 32 (+29% FLOPs recomputed" in note and "1.23x" in note
    # were small micro-batches far costlier, the same plan recomputes at the larger batch, and says that instead
    monkeypatch.setattr(memory, "MICRO_BATCH_OVERHEAD_TOKENS", 20000)
    slow = parse(recipe)
    assert (slow.device_batch_size, slow.model_config["activation_checkpointing"]) == (32, True)
    assert slow.config_sources["activation_checkpointing"] == "turned on: faster than more accumulation (the plan)"
    assert "recompute: activation checkpointing at batch 32" in "\n".join(slow.batch_notes)
    time = next(line for line in planning.plan_lines(parse([*recipe, "--peak_tflops=989"])) if line.startswith("time"))
    assert "+29% FLOPs recomputed (activation checkpointing)" in time
    # --activation_checkpointing given (either way) is the user's: the plan does not weigh it
    assert not parse([*recipe, "--activation_checkpointing=false"]).model_config["activation_checkpointing"]
