"""The depth probe (base_train --probe=hops): its rows are mixed deterministically at the share asked, its
evaluation gives 1.0 for a model that knows the answers and about chance for one that guesses, and base_train logs
it."""

import random
from types import SimpleNamespace

import pytest
import torch

from nanochat.data.synthetic import hops_answers
from nanochat.eval.hops_eval import encode_hops, evaluate_hops
from nanochat.train import config as train_config
from nanochat.train import planning
from nanochat.train import probe as probe_module
from nanochat.trainer import Run
from tests.test_hops_eval import BYTES, FakeModel, logits_with, oracle

PROBE = probe_module.build("hops", share=0.1, seed=42, eval_docs=64)


def text_batch(rows=16, length=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 200, (rows, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def probe_document_tokens():
    """A probe document's byte-level tokens, counted here: <|bos|> and one byte a character."""
    return 1 + len(PROBE.eval_documents()[0].encode())


def test_over_a_run_the_share_of_tokens_is_the_one_asked_and_every_rank_mixes_as_many():
    L = probe_document_tokens()
    assert PROBE.document_tokens(BYTES) == L
    counts = [PROBE.rows_at(step, micro, 2, 16, 257, L) for step in range(100) for micro in range(2)]
    assert abs(sum(counts) * L - 0.1 * 16 * 257 * 2 * 100) <= L  # within one document of 10% of the tokens
    assert set(counts) == {3, 4}  # floor or ceil of 0.1 x 16 x 257 / 111 = 3.7 rows a micro-batch
    assert {PROBE.rows_at(s, 0, 1, 16, 257, 10) for s in range(5)} == {16}  # at most one document a row, every row


def test_a_mixed_row_is_one_hops_document_at_its_start_then_its_own_text():
    x, y = text_batch(length=256)
    mx, my = PROBE.mix(x, y, BYTES, step=3, micro=0, micro_steps=1, rank=0)
    n, m = PROBE.rows_at(3, 0, 1, 16, 257, probe_document_tokens()), probe_document_tokens()
    assert n >= 1 and torch.equal(mx[:-n], x[:-n]) and torch.equal(my[:-n], y[:-n])
    bos = BYTES.get_bos_token_id()
    for r in range(16 - n, 16):
        doc = mx[r, :m].tolist()
        assert doc[0] == bos and bos not in doc[1:]  # one document, <|bos|>-led
        text = bytes(doc[1:]).decode()
        assert " ; " in text and "=" in text and len(hops_answers(text)) == PROBE.spec.n_queries  # all its queries
        assert my[r, :m - 1].tolist() == doc[1:] and my[r, m - 1] == -1  # its next tokens; its last predicts nothing
        assert torch.equal(mx[r, m:], x[r, m:]) and torch.equal(my[r, m:], y[r, m:])  # then the row's own text
    assert torch.equal(x, text_batch(length=256)[0])  # the caller's tensors are not written to


def test_a_row_shorter_than_a_document_holds_its_start():
    x, y = text_batch(rows=4, length=64)
    mx, my = probe_module.build("hops", share=0.9, seed=1, eval_docs=8).mix(x, y, BYTES, 0, 0, 1, rank=0)
    assert mx[-1, 0] == BYTES.get_bos_token_id() and torch.equal(mx[-1, 1:], my[-1, :-1])  # a document throughout
    assert (my[-1] >= 0).all()


def test_the_mixed_stream_is_a_function_of_the_step_so_a_resumed_run_mixes_the_same_rows():
    x, y = text_batch(length=256)  # every step mixes a row or more
    resumed = probe_module.build("hops", share=0.1, seed=42, eval_docs=64)  # a new process's probe
    for step in (0, 7, 8):
        first = PROBE.mix(x, y, BYTES, step, 0, 1, rank=1)
        again = resumed.mix(x, y, BYTES, step, 0, 1, rank=1)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    other_rank = PROBE.mix(x, y, BYTES, 7, 0, 1, rank=0)[0]
    assert not torch.equal(other_rank, PROBE.mix(x, y, BYTES, 7, 0, 1, rank=1)[0])


def guesser(seed):
    """A model that answers each query with a random symbol of the table: about one in n_symbols right."""
    rng = random.Random(seed)

    def policy(step, hops, answer, symbols):
        return logits_with({rng.choice(symbols): 1.0})
    return policy


def test_the_evaluation_is_one_for_an_oracle_and_about_chance_for_a_guesser():
    documents = PROBE.eval_documents()
    assert documents == probe_module.build("hops", 0.1, 42, 64).eval_documents()  # the same at every evaluation
    right = evaluate_hops(FakeModel(oracle), BYTES, documents, n_steps=2)
    assert right["accuracy"] == [[1.0] * 4] * 2 and right["hops"] == [1, 2, 3, 4]
    guessed = evaluate_hops(FakeModel(guesser(0)), BYTES, documents, n_steps=1)
    assert guessed["chance"] == pytest.approx(1 / 8)
    assert all(abs(a - 1 / 8) < 0.07 for a in guessed["accuracy"][0])  # ~250 answers per hop count


def test_base_train_prints_and_logs_the_probe_at_each_evaluation(capsys):
    logged = []
    run = SimpleNamespace(published=FakeModel(oracle), tokenizer=BYTES, probe=PROBE, device=torch.device("cpu"),
                          run_config=SimpleNamespace(device_batch_size=8, device_type="cpu", dtype="float32"), rank=0,
                          world_size=1, metrics=SimpleNamespace(log=logged.append))
    run.published.config.n_sup_inference = 3
    Run.evaluate_probe(run, step=250)
    assert "probe: 4 hops by step 1.00 1.00 1.00 | at step 3, by hops 1:1.00 2:1.00 3:1.00 4:1.00 (chance 0.12)" \
        in capsys.readouterr().out
    [record] = logged
    assert record["kind"] == "probe" and record["step"] == 250 and record["longest_hops_by_step"] == [1.0] * 3


def test_an_unknown_probe_or_share_is_refused():
    with pytest.raises(ValueError, match="--probe='mazes' is unknown; choose one of none, hops"):
        probe_module.build("mazes", 0.1, 0, 8)
    assert probe_module.build("none", 0.1, 0, 8) is None


def test_every_probe_document_is_answerable_by_the_tokenizer_one_answer_a_token():
    doc = PROBE.eval_documents()[0]
    ids, answers = encode_hops(BYTES, doc)
    assert len(answers) == len(hops_answers(doc)) == PROBE.spec.n_queries


def test_the_plan_states_what_the_probe_costs():
    flags = ["--depth=2", "--num_iterations=100", "--device_batch_size=4", "--max_seq_len=256"]
    lines = planning.plan_lines(train_config.parse_args(flags + ["--probe=hops", "--probe_share=0.1"], world_size=1,
                                                        check_hardware=False, vocab_size=256))
    [line] = [line for line in lines if line.startswith("probe ")]
    assert "10% of the training tokens are hops documents, one at the start of" in line
    assert "256 documents at each eval" in line
    assert not any(line.startswith("probe ") for line in planning.plan_lines(
        train_config.parse_args(flags, world_size=1, check_hardware=False, vocab_size=256)))


def test_a_base_train_run_with_the_probe_trains_on_its_rows_and_logs_it_at_each_eval(base_dir, monkeypatch):
    import json
    import os

    from tests.support.helpers import TINY, ckpt_dir
    from tests.test_base_train import run
    mix, written = probe_module.Probe.mix, []

    def recorded(self, x, y, *args):
        mx, my = mix(self, x, y, *args)
        written.append(int((mx != x).any(dim=1).sum()))  # rows that now start with a probe document
        return mx, my
    monkeypatch.setattr(probe_module.Probe, "mix", recorded)
    out = run(base_dir, *TINY, "--max_seq_len=128", "--num_iterations=4", "--probe=hops", "--probe_share=0.5",
              "--probe_docs=8", "--model_tag=probed").stdout
    assert len(written) == 4 and sum(written) >= 3  # ~0.5 x 129 / ~100 tokens of a document: a row a step, about
    assert out.count("probe: 4 hops by step ") == 2 and "the depth probe was skipped" not in out
    with open(os.path.join(ckpt_dir(base_dir, "probed"), "metrics.jsonl")) as f:
        probes = [r for r in map(json.loads, f) if r["kind"] == "probe"]
    assert [r["step"] for r in probes] == [0, 4] and all(len(r["accuracy"]) == 2 for r in probes)
