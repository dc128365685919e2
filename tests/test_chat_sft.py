"""scripts/chat_sft.py on a tiny base model with non-default recursion settings: the fine-tuned checkpoint keeps the
base's config and reloads with it, starts from the base's weights, trains every supervision step, resumes exactly,
and bad input stops with one line and writes nothing."""

import contextlib
import io
import json
import os
import subprocess

import pytest
import torch

from nanochat.cli import ExitCode
from nanochat.data.chat_tasks import builtin_items
from tests.support.helpers import TINY, ckpt_dir, tree, weights

# the base: every recursion setting away from its default, as a fine-tuning run must keep them
BASE = TINY + ["--max_seq_len=128", "--n_loops=2", "--T_recursion=2", "--n_sup_train=3", "--state_update=stream",
               "--preset=extreme", "--n_sup_inference=4", "--num_iterations=1", "--eval_every=0", "--model_tag=base"]
SFT = ["--model_tag=base", "--step=1", "--device_batch_size=2", "--eval_tokens=256", "--sample_every=0",
       "--sample_tokens=4"]


def run(base_dir, script, *flags):
    """An entry point's main in this process: a CompletedProcess of its exit status (a message exit: 1) and output."""
    import importlib
    main = importlib.import_module(f"scripts.{script}").main
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        try:
            main(list(flags))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                err.write(e.code + "\n")
    return subprocess.CompletedProcess([script, *flags], code, out.getvalue(), err.getvalue())


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def meta(base_dir, tag, step):
    with open(os.path.join(ckpt_dir(base_dir, tag, step), "meta.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def chats(base_dir, tmp_path_factory):
    """base_dir with the base checkpoint (step 1) and a .jsonl of 60 built conversations; returns the file."""
    check(run(base_dir, "base_train", *BASE))
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for _, m in builtin_items("train", count=30)))
    return str(path)


def test_the_fine_tuned_checkpoint_keeps_the_base_config_and_trains_every_step(base_dir, chats):
    proc = check(run(base_dir, "chat_sft", *SFT, f"--data={chats}", "--num_iterations=4", "--eval_every=2"))
    assert "fine-tuning base step 1 on" in proc.stdout and "into base_sft" in proc.stdout
    base, sft = meta(base_dir, "base", 1), meta(base_dir, "base_sft", 4)
    assert sft["model_config"] == base["model_config"]
    assert (sft["model_config"]["n_loops"], sft["model_config"]["T_recursion"], sft["model_config"]["state_update"],
            sft["model_config"]["supervision_weight_base"], sft["model_config"]["n_sup_inference"]) == \
        (2, 2, "stream", 10.0, 4)
    assert sft["init_from"] == {"model_tag": "base", "step": 1, "data": chats}
    assert sft["data"]["conversations"] == 57 and sft["data"]["val_conversations"] == 3
    assert set(sft["config_sources"].values()) == {"base checkpoint base step 1"}
    assert sft["train_config"]["warmdown_ratio"] == 0.5 and sft["train_config"]["rows"] == "documents"
    with pytest.MonkeyPatch.context() as mp:  # reloads as the base model does, with the same recursion
        mp.setenv("NANOCHAT_BASE_DIR", base_dir)
        from nanochat import checkpoint as ckpt
        model, _, _ = ckpt.load_model("base_sft", "latest")
        base_model, _, _ = ckpt.load_model("base", 1)
        assert model.config == base_model.config
    with open(os.path.join(ckpt_dir(base_dir, "base_sft"), "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 4 and all(len(r["step_losses"]) == 3 for r in train)  # every supervision step scored
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2, 4]
    # an ordinary checkpoint: the base model's tools read it unchanged
    sample = check(run(base_dir, "base_sample", "--model_tag=base_sft", "--prompt=hi", "--max_tokens=3",
                       "--device_type=cpu", "--show_steps"))
    assert "step 4" in sample.stdout  # n_sup_inference=4: the draft of every step, the base's setting kept
    check(run(base_dir, "plot_run", "base_sft"))
    assert os.path.exists(os.path.join(ckpt_dir(base_dir, "base_sft"), "training.png"))
    # chat evaluation by supervision step, past the 4 steps of n_sup_inference too
    evaluated = check(run(base_dir, "chat_eval", "--model_tag=base_sft", "--limit=2", "--n_sup=5", "--max_tokens=4",
                          "--device_type=cpu"))
    assert "| step 5 |" in evaluated.stdout and "| step 3 (trained) |" in evaluated.stdout
    results = os.path.join(ckpt_dir(base_dir, "base_sft"), "chat_eval_step000004")
    with open(results + ".json") as f:
        result = json.load(f)
    assert result["steps"] == [1, 2, 3, 4, 5] and set(result["tasks"]) == {"arithmetic", "hops"}
    assert result["all"]["count"] == 4 and result["init_from"]["model_tag"] == "base"
    assert os.path.getsize(results + ".png") > 0 and os.path.exists(results + ".md")
    refused = run(base_dir, "chat_eval", "--model_tag=base_sft", f"--data={chats}.missing.jsonl", "--device_type=cpu")
    assert refused.returncode == ExitCode.USAGE and "cannot read it" in refused.stderr


def test_a_fresh_run_starts_from_the_base_weights(base_dir, chats):
    check(run(base_dir, "chat_sft", *SFT, f"--data={chats}", "--num_iterations=1", "--sft_tag=frozen",
              "--matrix_lr=0", "--embedding_lr=0", "--unembedding_lr=0", "--eval_every=0"))
    a, b = weights(base_dir, "base", 1), weights(base_dir, "frozen", 1)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_run_is_bit_identical_to_one_run_straight(base_dir, chats):
    flags = [*SFT, f"--data={chats}", "--eval_every=0", "--warmdown_ratio=0"]  # no schedule change with the horizon
    check(run(base_dir, "chat_sft", *flags, "--num_iterations=4", "--sft_tag=straight"))
    check(run(base_dir, "chat_sft", *flags, "--num_iterations=2", "--sft_tag=split"))
    resumed = check(run(base_dir, "chat_sft", *flags, "--num_iterations=4", "--sft_tag=split", "--resume"))
    assert "resumed split from step 2" in resumed.stdout
    a, b = weights(base_dir, "straight", 4), weights(base_dir, "split", 4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert meta(base_dir, "straight", 4)["dataloader"] == meta(base_dir, "split", 4)["dataloader"]
    # other conversations than the checkpoint was trained on: refused, as base_train refuses other shards
    other = chats.replace(".jsonl", "_other.jsonl")
    with open(chats) as f, open(other, "w") as g:
        g.write(f.read().replace("plus", "and"))
    refused = run(base_dir, "chat_sft", *flags[:-2], f"--data={other}", "--eval_every=0", "--warmdown_ratio=0",
                  "--num_iterations=6", "--sft_tag=split", "--resume")
    assert refused.returncode == 1 and "was trained on data" in refused.stderr


@pytest.mark.parametrize("flags, message, code", [
    (["--data={bad}"], "bad.jsonl line 2: message 1 is from the user, but the assistant is due", ExitCode.USAGE),
    (["--data={chats}", "--n_loops=3"], "--n_loops: the model's config is the base checkpoint's", 1),
    (["--data={chats}", "--preset=uniform"], "--preset: the model's config is the base checkpoint's", 1),
    (["--data={chats}", "--model_tag=nothing"], "no checkpoint found for model tag 'nothing'", ExitCode.USAGE),
    (["--data={chats}", "--sft_tag=base"], "is the base checkpoint's tag", 1),
    (["--data=hf:a:b:c:d"], "expected hf:NAME", ExitCode.USAGE),
])
def test_bad_input_stops_with_one_line_and_writes_nothing(base_dir, chats, tmp_path, flags, message, code):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                   + "\n" + json.dumps({"messages": [{"role": "user", "content": "q"}] * 2}) + "\n")
    before = tree(base_dir)
    proc = run(base_dir, "chat_sft", *SFT, *[f.format(bad=bad, chats=chats) for f in flags], "--num_iterations=1")
    assert proc.returncode == code and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert tree(base_dir) == before
