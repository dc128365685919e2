"""scripts/compare: budget arithmetic, a tiny grid end to end with interrupt and resume, identical data order."""

import itertools
import json
import os
import shutil
import subprocess

import pytest
import torch

from nanochat.data import dataloader
from nanochat.model.gpt import GPT, GPTConfig
from nanochat.train.flops import estimate_flops
from scripts import compare
from tests.support import forked, processes
from tests.support.helpers import base_train_child_in_process

TINY = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2", "--eval_tokens=128",
        "--sample_tokens=2", "--device_type=cpu",
        "--gradient_accumulation_steps=1"]
GRID = ["--config", "plain=--n_loops=0 --n_sup_train=1", "--config", "trm=--n_loops=1 --n_sup_train=2"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def base_dir(base_dir, monkeypatch):
    """The shared tiny corpus (tests/conftest.py) as NANOCHAT_BASE_DIR, for compare and the base_train it starts."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base_dir)
    return base_dir


@pytest.fixture(autouse=True)
def children_time_out(monkeypatch):
    """compare's base_train children get a hard timeout here: a hang fails the test instead of stalling CI."""
    def run_child(cmd, env=None):  # a process of its own, forked from the torch-preloaded server
        proc = forked.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.STDOUT)
        done = processes.finish(proc, timeout=300)
        print(done.stdout, end="")  # where the child's inherited stdout put it: this test's captured output
        return done.returncode, None

    monkeypatch.setattr(compare.lifecycle, "run_child", run_child)


def plan(*argv):
    return compare.plan(compare.parse_args(list(argv)), vocab_size=4096, world_size=1)


@pytest.mark.parametrize("budget", [["--num_iterations=20"], ["--target_flops=3e11"]])
def test_equal_flops_iterations_spend_the_same_flops_within_one_step(budget):
    runs = plan("--mode=flops", *budget, "--config", "plain=--n_loops=0 --n_sup_train=1",
                "--config", "trm=--n_loops=1 --n_sup_train=2", "--config", "deep=--n_loops=2 --n_sup_train=4",
                "--config", "sweeps=--n_loops=1 --n_sup_train=3 --T_recursion=2", "--", "--depth=2", "--n_embd=64",
                "--max_seq_len=128", "--device_batch_size=4", "--gradient_accumulation_steps=1",
                "--sample_n_sup=false", "--n_sup_warmup=0")  # fixed step counts; drawn ones: test_base_train
    recursion = {"plain": (0, 1, 1), "trm": (1, 2, 1), "deep": (2, 4, 1), "sweeps": (1, 3, 2)}
    for r in runs:  # each config's own recursion-aware estimate, not a plain model's
        n_loops, n_sup, sweeps = recursion[r.name]
        model = GPT(GPTConfig(sequence_len=128, vocab_size=4096, n_layer=2, n_embd=64, n_head=1, n_kv_head=1,
                              n_loops=n_loops, n_sup_train=n_sup, T_recursion=sweeps))
        assert r.flops_per_token == estimate_flops(model)
        assert r.train_flops == r.iterations * r.tokens_per_step * r.flops_per_token
    for a, b in itertools.combinations(runs, 2):
        one_step = max(r.flops_per_token * r.tokens_per_step for r in (a, b))
        assert abs(a.train_flops - b.train_flops) <= one_step, (a.name, b.name)
    by_name = {r.name: r for r in runs}
    assert by_name["plain"].iterations > by_name["trm"].iterations > by_name["deep"].iterations
    if budget == ["--num_iterations=20"]:  # the costliest config gets exactly the steps asked for
        assert max(runs, key=lambda r: r.flops_per_token).iterations == 20


@pytest.mark.parametrize("by", ["depth", "width"])
def test_params_mode_matches_plain_flops_within_ten_percent(by):
    runs = plan("--mode=params", f"--match_by={by}", "--num_iterations=7",
                "--config", "plain=--n_loops=0 --n_sup_train=1", "--config", "trm=--n_loops=2 --n_sup_train=4",
                "--", "--depth=2", "--n_embd=128", "--n_head=2", "--gradient_accumulation_steps=1")
    by_name = {r.name: r for r in runs}
    matched = [r for r in runs if r.matches]
    assert len(matched) == 1 and matched[0].matches == "trm"
    plain, trm = matched[0], by_name["trm"]
    assert abs(plain.flops_per_token / trm.flops_per_token - 1) <= 0.1
    assert plain.run_config.model_config["n_loops"] == 0 and plain.run_config.model_config["n_sup_train"] == 1
    grown, kept = ("n_layer", "n_embd") if by == "depth" else ("n_embd", "n_layer")
    assert plain.run_config.model_config[grown] > trm.run_config.model_config[grown]
    assert plain.run_config.model_config[kept] == trm.run_config.model_config[kept]
    assert plain.parameters > by_name["plain"].parameters == trm.parameters
    assert {r.iterations for r in runs} == {7}  # equal tokens


def read(path):
    with open(path, "rb") as f:
        return f.read()


def test_tiny_grid_end_to_end_then_interrupted_rerun_skips_finished_configs(base_dir, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "results")
    argv = ["--mode=flops", "--num_iterations=3", "--evals=1", f"--out={out}", *GRID, "--", *TINY]
    real_train, trained = compare.run_base_train, []

    def interrupted(argv):  # Ctrl-C as the second config starts
        if trained:
            raise KeyboardInterrupt
        trained.append(model_tag(argv))
        return real_train(argv)

    monkeypatch.setattr(compare, "run_base_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        compare.main(argv)
    with open(os.path.join(out, "compare.json")) as f:
        assert [r["name"] for r in json.load(f)["runs"]] == ["plain"]
    first = read(os.path.join(out, "compare.json"))

    # plain trained as a process above; the later children in this process (a start costs seconds here)
    monkeypatch.setattr(compare.lifecycle, "run_child", base_train_child_in_process)
    trained.clear()
    monkeypatch.setattr(compare, "run_base_train", lambda argv: trained.append(model_tag(argv)) or real_train(argv))
    capsys.readouterr()
    compare.main(argv)
    assert "plain: finished in an earlier invocation, skipping" in capsys.readouterr().out
    assert len(trained) == 1 and trained[0].startswith("compare_trm_")
    with open(os.path.join(out, "compare.json")) as f:
        report = json.load(f)
    plain, trm = report["runs"]
    assert json.loads(first)["runs"][0] == plain  # kept, not retrained
    assert plain["iterations"] > trm["iterations"] == 3
    assert len(trm["val_bpb"]) == 2 and [i["n_sup"] for i in trm["inference"]] == [1, 2, 3, 4]
    assert trm["inference"][1]["val_bpb"] == pytest.approx(trm["val_bpb"][1], abs=1e-4)  # the same validation tokens
    assert [i["n_sup"] for i in plain["inference"]] == [1]
    assert trm["evals"][-1]["train_flops"] == trm["train_flops"] and trm["final_bpb"] == trm["val_bpb"][-1]
    table = read(os.path.join(out, "compare.md")).decode()
    assert "| plain | " in table and "| trm | " in table and "n_sup=4" in table
    for png in ("bpb_vs_training.png", "bpb_vs_inference.png"):
        assert read(os.path.join(out, png))[:8] == b"\x89PNG\r\n\x1a\n"

    # plain to be redone (its entry gone): from its first write on, the report keeps the trm an earlier run finished,
    # so an interruption at any point loses nothing
    with open(os.path.join(out, "compare.json"), "w") as f:
        json.dump({**report, "runs": [trm]}, f)
    shutil.rmtree(os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_checkpoints", plain["tag"]))
    real_write, writes = compare.write_report, []
    monkeypatch.setattr(compare, "write_report", lambda r, o: writes.append([x["name"] for x in r["runs"]])
                        or real_write(r, o))
    compare.main(argv)
    assert writes == [["plain", "trm"], ["plain", "trm"]]


def model_tag(argv):
    return next(a.split("=", 1)[1] for a in argv if a.startswith("--model_tag="))


def test_equal_tokens_mode_feeds_every_config_the_identical_token_stream(base_dir, tmp_path, monkeypatch):
    """compare's base_train children in this process (as processes: the tiny grid above), every training batch each
    draws recorded under its model tag."""
    streams, tags = {}, []
    real_init, real_next = dataloader.DataLoader.__init__, dataloader.DataLoader.__next__

    def init(self, tokenizer, B, T, split, *args, **kwargs):
        real_init(self, tokenizer, B, T, split, *args, **kwargs)
        self.split = split

    def next_batch(self):
        x, y = real_next(self)
        if self.split == "train":
            streams.setdefault(tags[-1], []).append(torch.cat([x, y[:, -1:]], 1).tolist())
        return x, y

    def child(cmd, env=None):
        tags.append(model_tag(cmd))
        return base_train_child_in_process(cmd, env)

    monkeypatch.setattr(dataloader.DataLoader, "__init__", init)
    monkeypatch.setattr(dataloader.DataLoader, "__next__", next_batch)
    monkeypatch.setattr(compare.lifecycle, "run_child", child)
    compare.main(["--mode=tokens", "--num_iterations=4", "--evals=1", f"--out={tmp_path / 'out'}", *GRID, "--",
                  *TINY, "--gradient_accumulation_steps=2"])
    assert len(streams) == 2
    plain, trm = (streams[name] for name in sorted(streams))  # compare_plain_..., compare_trm_...
    assert len(plain) == 4 * 2  # 4 steps x 2 micro-batches
    assert plain == trm
    assert plain[0] != plain[2]  # a real stream, not one batch repeated


@pytest.mark.parametrize("argv, message", [
    (["--mode=equal"], "invalid choice: 'equal'"),
    (["--config", "trm=--n_loops=1", "--config", "trm=--n_loops=2"], "config names must be unique"),
    (["--config", "trm=--n_loops=1 --num_iterations=9"], "--num_iterations=9 is set by compare"),
    (["--config", "trm=--n_lops=1"], "config trm: base_train: error: unknown flag --n_lops; did you mean --n_loops?"),
    (["--config", "a=--n_loops=1", "--config", "b=--n_loops=0 --device_batch_size=4"], "same tokens in the same order"),
    (["--mode=params", "--config", "plain=--n_loops=0 --n_sup_train=1"], "needs at least one TRM config"),
])
def test_bad_input_exits_with_a_clear_message(base_dir, tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        compare.main([*argv, f"--out={tmp_path / 'results'}", "--", *TINY])
    assert exit_info.value.code not in (0, None)
    assert message in str(exit_info.value.code) + capsys.readouterr().err
    assert not os.path.exists(tmp_path / "results")


def test_without_batch_flags_every_config_gets_one_pinned_batch():
    # base_train's automatic batch grows with the model; a comparison must feed every config the same batches
    runs = plan("--mode=params", "--config", "plain=--n_loops=0 --n_sup_train=1", "--config",
                "trm=--n_loops=2 --n_sup_train=4", "--device_type=cuda", "--", "--depth=4", "--device_memory_gb=80")
    geometries = {json.dumps(compare.batch_geometry(r.run_config), sort_keys=True) for r in runs}
    assert len(geometries) == 1 and runs[0].run_config.total_batch_size == 524288


def test_a_figure_that_cannot_be_written_is_a_write_error_naming_it_and_leaves_no_temporary(tmp_path, monkeypatch):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanochat.files import WriteError
    from tests.support.unwritable import READ_ONLY, fail_writes
    fig, ax = plt.subplots()
    ax.plot([1, 2], label="a run")
    fail_writes(monkeypatch, tmp_path, READ_ONLY)
    with pytest.raises(WriteError, match=f"cannot write {tmp_path}/bpb.png: read-only file system"):
        compare.finish(fig, [ax], str(tmp_path / "bpb.png"))
    plt.close(fig)
    assert os.listdir(tmp_path) == []  # no temporary file


def test_the_recipe_grid_holds_the_parameters_equal_and_builds_prelude_and_coda():
    runs = plan("--mode=tokens", "--grid=recipe", "--num_iterations=3")
    assert {r.parameters for r in runs} == {runs[0].parameters}  # four unique blocks each
    core = next(r for r in runs if r.name == "trm2_pc_fullgrad_sampled")
    c = core.model.config
    assert (c.n_layer, c.n_prelude, c.n_coda, c.detach_between_steps, c.sample_n_sup) == (2, 1, 1, False, True)
