"""nanochat/eval/hops_eval.py with stand-in models whose answers are known (a solver written here, known probabilities),
and base_loss --hops end to end on a tiny checkpoint trained on a tiny hops corpus."""

import contextlib
import io
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from nanochat.data.synthetic import HopsSpec, hops_documents
from nanochat.data.tokenizer import RustBPETokenizer
from nanochat.eval.hops_eval import HopsEvalError, encode_hops, evaluate_hops, format_hops

BYTES = RustBPETokenizer.byte_level()
SPEC = HopsSpec(n_symbols=8, max_hops=4, n_queries=12)
SYMBOLS = "abcdefghijklmnopqrstuvwxyz"


def solve(prefix):
    """(hops, answer, symbols) of the query a prefix ending in 'x3=' asks, by composing the table's map."""
    table_text, _ = prefix.split(" ; ")
    table = dict(pair.split(">") for pair in table_text.split())
    y, hops = prefix[-3], int(prefix[-2])
    for _ in range(hops):
        y = table[y]
    return hops, y, sorted(table)


class FakeModel:
    """GPT's evaluation interface (config, refine, apply_coda, head) around a policy: at each '=' of the input, the
    logits policy(step, hops, answer, symbols) gives over the byte vocabulary; zeros elsewhere. Reads only the
    prefix up to each position, as a causal model does."""

    def __init__(self, policy, sequence_len=512):
        self.config = SimpleNamespace(vocab_size=BYTES.get_vocab_size(), sequence_len=sequence_len)
        self.policy = policy
        self.calls = []

    def refine(self, idx, n_sup):
        self.calls.append(tuple(idx.shape))
        B, T = idx.shape
        for step in range(1, n_sup + 1):
            y = torch.zeros(B, T, self.config.vocab_size)
            for b in range(B):
                for t in range(T):
                    if idx[b, t] == ord("="):
                        y[b, t] = self.policy(step, *solve(bytes(idx[b, 1:t + 1].tolist()).decode()))
            yield y, None

    def apply_coda(self, y):
        return y

    def head(self, y):
        return y


def logits_with(probabilities):
    """Logits over the byte vocabulary whose softmax is {char: p} (the rest: probability 0)."""
    logits = torch.full((BYTES.get_vocab_size(),), -1e4)
    for char, p in probabilities.items():
        logits[ord(char)] = math.log(p)
    return logits


def oracle(step, hops, answer, symbols):
    return logits_with({answer: 1.0})


def deep_oracle(step, hops, answer, symbols):
    """Right from the supervision step equal to its hop count on; before that a wrong symbol, surely."""
    return logits_with({answer if step >= hops else next(s for s in symbols if s != answer): 1.0})


def known(step, hops, answer, symbols):
    """p(answer) = q(step, hops), the rest spread evenly over the other symbols."""
    q = q_of(step, hops)
    return logits_with({s: q if s == answer else (1 - q) / (len(symbols) - 1) for s in symbols})


def q_of(step, hops):
    return [0.9, 0.3, 0.02][(step + hops) % 3]  # 0.02 < 0.98/7: the argmax is then a wrong symbol


def answers_by_hops(documents):
    """hop count -> number of answers, counted from the text here."""
    counts = {}
    for text in documents:
        for query in text.split(" ; ")[1].split():
            counts[int(query[1])] = counts.get(int(query[1]), 0) + 1
    return counts


def test_oracle_is_right_at_every_hop_and_step_across_batches_and_lengths():
    # two specs: documents of two lengths, so rows are padded; 13 documents in batches of 4, the last one short
    documents = hops_documents(1, 7, SPEC) + hops_documents(2, 6, HopsSpec(n_symbols=5, max_hops=3, n_queries=20))
    model = FakeModel(oracle)
    result = evaluate_hops(model, BYTES, documents, n_steps=3, batch_size=4)
    assert [shape[0] for shape in model.calls] == [4, 4, 4, 1]
    counts = answers_by_hops(documents)
    assert result["hops"] == [1, 2, 3, 4] and result["answers"] == [counts[h] for h in (1, 2, 3, 4)]
    assert result["accuracy"] == [[1.0] * 4] * 3
    assert all(bpb < 1e-3 for bpb in result["answer_bpb"])
    assert result["chance"] == pytest.approx(13 / (7 * 8 + 6 * 5))
    assert result["documents"] == 13
    assert "1 hops" in format_hops(result)


def test_accuracy_is_indexed_by_step_and_hop():
    result = evaluate_hops(FakeModel(deep_oracle), BYTES, hops_documents(3, 10, SPEC), n_steps=5, batch_size=3)
    assert result["accuracy"] == [[1.0 if step >= hops else 0.0 for hops in (1, 2, 3, 4)] for step in range(1, 6)]


def test_a_random_guesser_is_at_chance_per_hop_and_step():
    g = torch.Generator().manual_seed(0)

    def guess(step, hops, answer, symbols):
        return logits_with({s: 1 / len(symbols) for s in symbols}) + 0.1 * torch.rand(BYTES.get_vocab_size(),
                                                                                      generator=g)
    documents = hops_documents(4, 400, SPEC)  # 4800 answers: ~1200 per hop, std of an accuracy ~0.01
    result = evaluate_hops(FakeModel(guess), BYTES, documents, n_steps=2, batch_size=64)
    for row in result["accuracy"]:
        assert row == pytest.approx([1 / 8] * 4, abs=0.04)
    assert result["answer_bpb"] == pytest.approx([3.0, 3.0], abs=0.01)  # ~uniform over 8 symbols: 3 bits a byte


def test_answer_bpb_is_minus_log2_p_over_bytes():
    documents = hops_documents(5, 20, SPEC)
    result = evaluate_hops(FakeModel(known), BYTES, documents, n_steps=4, batch_size=8)
    counts = answers_by_hops(documents)
    for step in range(1, 5):
        bits = sum(n * -math.log2(q_of(step, h)) for h, n in counts.items())
        assert result["answer_bpb"][step - 1] == pytest.approx(bits / sum(counts.values()), rel=1e-5)  # 1 byte each
        assert result["answer_bpb_by_hops"][step - 1] == pytest.approx(
            [-math.log2(q_of(step, h)) for h in (1, 2, 3, 4)], rel=1e-5)
        assert result["accuracy"][step - 1] == [0.0 if q_of(step, h) == 0.02 else 1.0 for h in (1, 2, 3, 4)]


def test_bpe_pieces_keep_each_answer_one_token():
    documents = hops_documents(6, 50, SPEC)
    bpe = RustBPETokenizer.train_from_iterator(iter(documents), 400)
    assert any(len(bpe.encode(q)) == 1 for q in ("a1=b", "=b", "=b ", "b a"))  # merges exist that would fuse them
    for text in documents[:5]:
        ids, answers = encode_hops(bpe, text)
        assert bpe.decode(ids[1:]) == text and ids[0] == bpe.get_bos_token_id()
        expected = [(q[1], q[3]) for q in text.split(" ; ")[1].split()]
        assert [(str(h), bpe.decode([ids[i]])) for i, h, _, _ in answers] == expected
        assert all(ids[i] == t and n == 1 for i, _, t, n in answers)


def test_refusals_are_one_clear_line():
    class SplitsLetters:
        """A tokenizer under which a letter alone is two tokens."""
        def get_bos_token_id(self):
            return 256

        def encode(self, text):
            return [b for ch in text.encode() for b in ((ch, ch) if len(text) == 1 else (ch,))]
    with pytest.raises(HopsEvalError, match=r"answer character '.' is 2 tokens.*tok_train --byte_level"):
        evaluate_hops(FakeModel(oracle), SplitsLetters(), hops_documents(0, 2, SPEC), n_steps=1)
    # 31 table chars, 3 separator, 59 query chars: with <|bos|> first and the last token only a target, 93 inputs
    with pytest.raises(HopsEvalError, match=r"up to 93 tokens, longer than the model's 50-token context"):
        evaluate_hops(FakeModel(oracle, sequence_len=50), BYTES, hops_documents(0, 2, SPEC), n_steps=1)
    with pytest.raises(HopsEvalError, match="holds no hops query"):
        evaluate_hops(FakeModel(oracle), BYTES, ["def f(x): return x"], n_steps=1)


# ---------------------------------------------------------------------------------------------------- base_loss

@pytest.fixture(scope="module")
def hops_checkpoint(tmp_path_factory):
    """A base directory with a tiny hops corpus, the byte-level tokenizer and a tiny model trained 2 steps on it."""
    from nanochat.data import dataset
    from scripts import base_train, tok_train
    from tests.support import helpers
    base = str(tmp_path_factory.mktemp("hops"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", base)
        mp.delenv("NANOCHAT_DATA_DIR", raising=False)
        mp.setenv("HF_HOME", os.path.join(base, "hf"))
        # 6 queries: 55-token documents (with <|bos|>, less the last target) fit the 64-token context
        assert dataset.main(["--synthetic=hops", "--synthetic_docs=400", "--hops_symbols=6", "--hops_max=3",
                             "--hops_queries=6"]) == 0
        assert tok_train.main(["--byte_level"]) == 0
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            base_train.main(helpers.TINY + ["--max_seq_len=64", "--num_iterations=2", "--eval_every=0",
                                            "--model_tag=hops"])
    assert "samples: off, the corpus is a generated one" in out.getvalue() and "sample: " not in out.getvalue()
    return base


def test_base_loss_hops_writes_accuracy_by_hop_and_step(hops_checkpoint, monkeypatch, capsys):
    from scripts import base_loss
    monkeypatch.setenv("NANOCHAT_BASE_DIR", hops_checkpoint)
    results = base_loss.main(["--model_tag=hops", "--device_type=cpu", "--hops", "--device_batch_size=4"])
    out = capsys.readouterr().out
    assert "accuracy by hops" in out and "for supervision steps 1..4 (trained with 2)" in out
    path = os.path.join(hops_checkpoint, "base_checkpoints", "hops", "hops_eval_step000002.json")
    with open(path) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(results))
    assert set(saved) == {"model_tag", "step", "n_sup_train", "n_sup_inference", "steps", "corpus", "hops", "answers",
                          "accuracy", "answer_bpb", "answer_bpb_by_hops", "chance", "documents"}
    assert saved["steps"] == 4 and saved["n_sup_train"] == saved["n_sup_inference"] == 2
    assert saved["hops"] == [1, 2, 3] and saved["documents"] == 8 and sum(saved["answers"]) == 8 * 6
    assert len(saved["accuracy"]) == len(saved["answer_bpb"]) == len(saved["answer_bpb_by_hops"]) == 4
    assert all(len(row) == 3 and all(0 <= v <= 1 for v in row) for row in saved["accuracy"])
    assert saved["chance"] == pytest.approx(1 / 6) and saved["corpus"].startswith("synthetic: --synthetic=hops")
    pytest.importorskip("matplotlib")
    assert os.path.getsize(path.replace(".json", ".png")) > 0


def test_base_loss_hops_n_sup_sets_the_steps(hops_checkpoint, monkeypatch):
    from scripts import base_loss
    monkeypatch.setenv("NANOCHAT_BASE_DIR", hops_checkpoint)
    results = base_loss.main(["--model_tag=hops", "--device_type=cpu", "--hops", "--n_sup=3", "--hops_docs=2"])
    assert results["steps"] == 3 and len(results["accuracy"]) == 3 and results["documents"] == 2


def test_base_loss_hops_refuses_another_corpus(hops_checkpoint, tmp_path, monkeypatch):
    from scripts import base_loss
    from tests.conftest import make_corpus
    from tests.support.helpers import tree
    monkeypatch.setenv("NANOCHAT_BASE_DIR", hops_checkpoint)
    make_corpus(tmp_path / "words")
    monkeypatch.setenv("NANOCHAT_DATA_DIR", str(tmp_path / "words"))
    before = tree(hops_checkpoint)
    with pytest.raises(SystemExit, match=r"^base_loss: --hops needs the hops corpus, but .*words holds no recorded "
                                         r"corpus; build it with python -m nanochat.dataset --synthetic=hops"):
        base_loss.main(["--model_tag=hops", "--device_type=cpu", "--hops"])
    with pytest.raises(SystemExit, match="--hops evaluates every supervision step, not halting; drop --halt"):
        base_loss.main(["--model_tag=hops", "--device_type=cpu", "--hops", "--halt=kl:0.1"])
    assert tree(hops_checkpoint) == before


def test_plot_hops_compares_the_newest_result_of_each_tag(tmp_path, monkeypatch, capsys):
    from dev import plot_hops
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    runs = {"trm": {10: [[0.9, 0.5], [1.0, 0.6]], 20: [[1.0, 0.7], [1.0, 0.95]]}, "plain": {20: [[1.0, 0.25]]}}
    for tag, by_step in runs.items():
        os.makedirs(tmp_path / "base_checkpoints" / tag)
        for step, accuracy in by_step.items():
            result = {"hops": [1, 2], "accuracy": accuracy, "chance": 0.2}
            (tmp_path / "base_checkpoints" / tag / f"hops_eval_step{step:06d}.json").write_text(json.dumps(result))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit, match=r"no hops_eval_step\*.json for --model_tag=none: run `python -m "
                                         r"scripts.base_loss --model_tag=none --hops` first"):
        plot_hops.main(["trm", "none", "--out", str(tmp_path / "no.png")])
    assert sorted(os.listdir(tmp_path)) == before
    pytest.importorskip("matplotlib")
    plot_hops.main(["trm", "plain", "--out", str(tmp_path / "cmp.png")])
    out = capsys.readouterr().out
    assert "trm (2 hops): 0.70 0.95" in out and "plain (2 hops): 0.25" in out  # step 20's rows, the longest hops
    assert "WARNING" not in out  # both learned the one-hop lookup
    assert os.path.getsize(tmp_path / "cmp.png") > 0


def test_plot_hops_warns_of_a_run_that_never_learned_one_lookup():
    from dev.plot_hops import plateau_warning
    stuck = {"hops": [1, 2, 3], "accuracy": [[0.17, 0.16, 0.16], [0.2, 0.15, 0.16]], "chance": 1 / 7}
    assert "1 hop at 0.20 at best (chance 0.14)" in plateau_warning("s43", stuck)
    learned = {"hops": [1, 2, 3], "accuracy": [[0.3, 0.1, 0.1], [0.97, 0.34, 0.23]], "chance": 1 / 7}
    assert plateau_warning("s44", learned) is None


def test_hops_plots_mark_the_trained_steps_carry_warnings_and_show_a_one_step_model():
    """Issue 51's demo plot: the trained step N is marked, a plateau warning stands on the plot (not only in the
    console), and a one-step model's own plot shows its points (the x-axis ran 0.96-1.04 around nothing)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from nanochat.eval.hops_eval import hops_figure
    fig = hops_figure("t", [("trm", [0.2, 0.9, 1.0, 1.0, 0.9]), ("plain", [0.3])], 0.14, trained_steps=4,
                      warnings=["WARNING plain: 1 hop at 0.20 at best"])
    ax = fig.axes[0]
    assert any(list(line.get_xdata()) == [4, 4] for line in ax.get_lines())  # the vertical line at N
    assert "trained steps N=4" in [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("WARNING plain" in t.get_text() for t in fig.texts)
    plt.close(fig)
    fig = hops_figure("plain", [("1 hop", [1.0]), ("2 hops", [0.9]), ("3 hops", [0.3])], 0.14)
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.5, 1.5) and list(ax.get_xticks()) == [1]
    assert [list(line.get_xdata()) for line in ax.get_lines()][:3] == [[1], [1], [1]]  # a marker per hop count
    assert all(line.get_marker() == "o" for line in ax.get_lines()[:3])
    plt.close(fig)


def test_pairs_documents_are_read_from_their_own_text():
    text = hops_documents(2, 1, SPEC, family="hops_pairs")[0]  # "<8 table characters> ; 3ac 1bd ..."
    ids, answers = encode_hops(BYTES, text)
    queries = text.split(" ; ")[1].split()
    assert [(hops, token) for _, hops, token, _ in answers] == [(int(q[0]), ord(q[2])) for q in queries]
    assert all(ids[i] == token and ids[i - 1] == ord(q[1]) for (i, _, token, _), q in zip(answers, queries))
    result = evaluate_hops(FakeModel(oracle), BYTES, [text], n_steps=1)  # no '=' in it: the guesser sees zeros
    assert result["chance"] == pytest.approx(1 / 8) and sum(result["answers"]) == len(queries)
