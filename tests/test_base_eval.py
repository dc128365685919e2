"""base_eval: lm-eval scores a checkpoint on a local task, at every supervision step, with the model's own numbers."""

import json
import os
import sys

import pytest
import torch

from scripts import base_eval
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint

ATOL = 1e-4
DOCS = [  # a multiple-choice task in the tiny model's world; every prompt fits its 32-token context
    {"question": "the cat sat on the", "choices": ["mat", "log", "dog"], "answer": 0},
    {"question": "the dog sat on the", "choices": ["cat", "log", "mat"], "answer": 1},
    {"question": "the cat", "choices": ["sat", "on", "the log"], "answer": 0},
    {"question": "on the mat. the", "choices": ["dog", "cat sat", "log"], "answer": 0},
]
TASK = "tiny_choice"
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {output_type}
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    base_dir = tiny_checkpoint(tmp_path_factory)[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
        yield base_dir


@pytest.fixture(scope="module", autouse=True)
def one_task_index():
    """lm-eval's TaskManager reads every task file it ships (~15 s on 2 cores) into an index that nothing changes:
    built once for the module's include path, not at every base_eval.main."""
    built = {}

    def task_manager(include_path=None, **kwargs):
        key = (include_path, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = real(include_path=include_path, **kwargs)
        return built[key]

    real = base_eval.TaskManager
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(base_eval, "TaskManager", task_manager)
        yield


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """No network, and the datasets cache in the test's directory. The libraries read the variables once, at import
    (so for this process their config is patched: setting them at import would turn every later test offline)."""
    import datasets
    import huggingface_hub
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tasks")
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (directory / f"{TASK}.yaml").write_text(YAML.format(task=TASK, data=data, output_type="multiple_choice"))
    (directory / "tiny_generate.yaml").write_text(YAML.format(task="tiny_generate", data=data,
                                                             output_type="generate_until"))
    return directory


def loglikelihood_by_hand(model, tokenizer, context, continuation, n_sup):
    """log P(continuation | <|bos|> context) from the model's logits after n_sup supervision steps."""
    prefix = tokenizer.encode(context, prepend="<|bos|>")
    ids = tokenizer.encode(context + continuation, prepend="<|bos|>")
    assert ids[:len(prefix)] == prefix  # the continuation's tokens start where the context's end
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids[:-1]]), n_sup=n_sup)[0].double(), dim=-1)
    return sum(logprobs[i - 1, ids[i]].item() for i in range(len(prefix), len(ids)))


@pytest.fixture(scope="module")
def hand(base_dir):
    """[step][doc][choice] log-likelihoods for steps 1..4 (one past the 3 trained)."""
    from nanochat.checkpoint.manager import load_model
    model, tokenizer, _ = load_model(MODEL_TAG, "latest")
    return [[[loglikelihood_by_hand(model, tokenizer, doc["question"], " " + choice, n_sup)
              for choice in doc["choices"]] for doc in DOCS] for n_sup in range(1, 5)]


def test_lm_eval_loglikelihoods_equal_the_models_at_every_step(base_dir, task_dir, hand):
    from nanochat.checkpoint.manager import load_model
    model, tokenizer, _ = load_model(MODEL_TAG, "latest")
    lm = base_eval.NanochatLM(model, tokenizer, n_sup=4, batch_size=3)
    manager = base_eval.task_manager([TASK], str(task_dir))
    per_step = base_eval.evaluate_steps(lm, [TASK], manager, log_samples=True, bootstrap_iters=0)
    assert len(per_step) == 4
    for step, out in enumerate(per_step):
        samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
        assert len(samples) == len(DOCS)
        for sample, expected in zip(samples, hand[step]):
            got = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
            assert got == pytest.approx(expected, abs=ATOL), f"supervision step {step + 1}"
    assert len({round(h[0][0], 6) for h in hand}) == 4  # the steps differ: a wrong step cannot pass by accident


def test_a_context_longer_than_the_model_keeps_its_last_tokens(base_dir):
    from lm_eval.api.instance import Instance

    from nanochat.checkpoint.manager import load_model
    model, tokenizer, _ = load_model(MODEL_TAG, "latest")
    context, continuation = "the cat sat on the mat. " * 12 + "the dog sat on the", " log"
    ids = tokenizer.encode(context + continuation, prepend="<|bos|>")
    T, n = model.config.sequence_len, len(tokenizer.encode(continuation))
    assert len(ids) > 2 * T
    kept = torch.tensor([ids[-(T + 1):]])  # the model's whole context, ending where the continuation ends
    with torch.no_grad():
        logprobs = torch.log_softmax(model(kept[:, :-1], n_sup=3)[0].double(), dim=-1)
    expected = sum(logprobs[i - 1, kept[0, i]].item() for i in range(T + 1 - n, T + 1))
    request = Instance(request_type="loglikelihood", doc={}, arguments=(context, continuation), idx=0)
    [(got, _)] = base_eval.NanochatLM(model, tokenizer, n_sup=3).loglikelihood([request])
    assert got == pytest.approx(expected, abs=ATOL)


def test_rolling_loglikelihood_is_the_whole_texts(base_dir):
    from lm_eval.api.instance import Instance

    from nanochat.checkpoint.manager import load_model
    model, tokenizer, _ = load_model(MODEL_TAG, "latest")
    lm = base_eval.NanochatLM(model, tokenizer, n_sup=2)
    text = "the cat sat on the log."
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    [total] = lm.loglikelihood_rolling([request])
    assert total == pytest.approx(loglikelihood_by_hand(model, tokenizer, "", text, n_sup=2), abs=ATOL)


def test_base_eval_writes_accuracy_per_step_to_json_and_report(base_dir, task_dir, hand, capsys):
    run_dir = base_dir / "base_checkpoints" / MODEL_TAG
    results = base_eval.main(["--model_tag", MODEL_TAG, "--tasks", TASK, "--include_path", str(task_dir),
                              "--n_sup", "4", "--device_type", "cpu"])
    expected = [sum(max(range(len(lls)), key=lls.__getitem__) == doc["answer"] for lls, doc in zip(step, DOCS))
                / len(DOCS) for step in hand]
    saved = json.loads((run_dir / f"base_eval_step{results['step']:06d}.json").read_text())
    assert saved["tasks"][TASK]["acc"] == pytest.approx(expected)
    assert set(saved["tasks"][TASK]) == {"acc", "acc_stderr"}  # metrics only, not lm-eval's alias or sample_len
    assert saved["n_sup"] == 4 and saved["n_sup_train"] == 3 and len(saved["tasks"][TASK]["acc_stderr"]) == 4
    assert "note: 4 supervision steps, past the 3 the model was trained with" in capsys.readouterr().out
    report = (run_dir / "report.md").read_text()
    row = f"| {TASK} | acc | " + " | ".join(f"{v:.4f}" for v in expected) + " |"
    assert "## Downstream tasks per supervision step (scripts.base_eval)" in report and row in report
    base_eval.main(["--model_tag", MODEL_TAG, "--tasks", TASK, "--include_path", str(task_dir), "--n_sup", "4",
                    "--device_type", "cpu"])
    assert (run_dir / "report.md").read_text() == report  # the section is replaced, not appended again


BASE_EVAL_RESULT = {"model_tag": "t", "step": 10, "n_sup": 2, "n_sup_train": 2, "lm_eval_version": "0.4.13",
                    "limit": None, "num_fewshot": None,
                    "tasks": {"piqa": {"acc": [0.5, 0.625], "acc_stderr": [0.1, 0.1]}, "toy": {"ppl": [3.0, 2.0]}}}


def test_base_train_keeps_the_downstream_section_when_it_rebuilds_the_report(tmp_path):
    from nanochat.eval import metrics
    (tmp_path / "base_eval_step000010.json").write_text(json.dumps(BASE_EVAL_RESULT))
    section = metrics.downstream_section(str(tmp_path))
    assert "| piqa | acc | 0.5000 | 0.6250 |" in section and "stderr" not in section
    (tmp_path / "report.md").write_text("# Run report\n" + section)
    metrics.refresh_downstream_section(str(tmp_path))
    assert (tmp_path / "report.md").read_text() == "# Run report\n" + section


def test_plot_run_draws_the_task_accuracies_per_step(tmp_path):
    from scripts import plot_run
    records = [{"kind": "train", "step": s, "loss": 2.0, "step_losses": [2.1, 2.0], "refinement": 0.05,
                "grad_norm": 1.0, "dt": 0.5} for s in (1, 2)] + [{"kind": "eval", "step": 2, "val_bpb": [1.2, 1.1]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert len(plot_run.figure(str(tmp_path)).axes) == 5  # no base_eval result: no second axis
    (tmp_path / "base_eval_step000010.json").write_text(json.dumps(BASE_EVAL_RESULT))
    twin = plot_run.figure(str(tmp_path)).axes[-1]
    [line] = twin.get_lines()  # accuracies only: a perplexity has another scale
    assert list(line.get_ydata()) == [0.5, 0.625] and line.get_label().startswith("piqa accuracy")


def snapshot(path):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "no_such_task"], "unknown task(s) no_such_task; list them with `lm_eval ls tasks`"),
    (["--tasks", TASK, "--n_sup", "0"], "--n_sup=0 must be > 0"),
    (["--tasks", TASK, "--limit", "-1"], "--limit=-1.0 must be > 0"),
    (["--tasks", "tiny_generate"], "base_eval scores tasks by log-likelihood; for generation tasks export"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, message, base_dir, task_dir):
    before = snapshot(base_dir)
    with pytest.raises(SystemExit) as e:
        base_eval.main(["--model_tag", MODEL_TAG, "--include_path", str(task_dir), "--device_type", "cpu", *argv])
    assert message in str(e.value) and "\n" not in str(e.value)
    assert snapshot(base_dir) == before


def test_a_missing_include_path_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--include_path .*nowhere is not a directory"):
        base_eval.parse_args(["--include_path", str(tmp_path / "nowhere")])


def test_without_lm_eval_it_says_what_to_install(monkeypatch):
    """In process: the script's import stops with sys.exit(message), which Python prints as one line, exit status 1."""
    import runpy
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(SystemExit) as e:
        runpy.run_module("scripts.base_eval", run_name="__main__")
    assert isinstance(e.value.code, str) and "\n" not in e.value.code, e.value.code
    assert "pip install -e '.[eval]'" in e.value.code
