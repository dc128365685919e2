"""Chat evaluation by supervision step (nanochat/eval/chat_eval.py): exact match and the ended rate per task and step,
scored from the replies the engine gives at each step; the items it reads and their errors."""

import json

import pytest

from nanochat.data import chat
from nanochat.data.tokenizer import RustBPETokenizer
from nanochat.eval import chat_eval
from nanochat.model.engine import Engine
from tests.support.helpers import random_model, tiny_config

TOK = RustBPETokenizer.byte_level()


def qa(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_exact_match_and_ended_are_scored_per_task_at_every_step(monkeypatch):
    items = [("add", qa("1+1?", "two")), ("add", qa("2+2?", "four")), ("hops", qa("a>b b>a; a?", "b"))]
    # what the model replies after s supervision steps, per question: step 1 wrong, step 2 right but cut at
    # max_tokens for the second question, step 3 right and ended everywhere (the reply's spaces do not count)
    replies = {1: ["three", "five", "a"], 2: ["two", "four" + "x" * 20, " b "], 3: [" two", "four", "b"]}
    seen = []

    def generate_batch(self, prompts, max_tokens, temperature, n_sup, stop_tokens):
        assert temperature == 0 and stop_tokens == {TOK.encode_special("<|assistant_end|>")}
        seen.append((n_sup, prompts))
        return [TOK.encode(r)[:max_tokens] for r in replies[n_sup]]  # one batch of the three

    monkeypatch.setattr(Engine, "generate_batch", generate_batch)
    model = random_model(tiny_config(vocab_size=TOK.get_vocab_size(), sequence_len=64))
    result = chat_eval.evaluate_chat(model, TOK, items, n_steps=3, batch_size=3, max_tokens=8)
    assert [n for n, _ in seen] == [1, 2, 3]
    assert seen[0][1][2] == chat.render_prompt(TOK, items[2][1][:-1])  # answered from the chat rendering
    assert result["steps"] == [1, 2, 3]
    assert result["tasks"]["add"] == {"count": 2, "constant": 0.5, "accuracy": [0.0, 0.5, 1.0],
                                      "ended": [1.0, 0.5, 1.0]}
    assert result["tasks"]["hops"] == {"count": 1, "constant": 1.0, "accuracy": [0.0, 1.0, 1.0],
                                       "ended": [1.0, 1.0, 1.0]}
    assert result["all"]["accuracy"] == [0.0, 2 / 3, 1.0]
    assert result["examples"]["add"][0] == {"question": "1+1?", "answer": "two", "replies": ["three", "two", "two"]}
    table = chat_eval.format_chat_eval(result, trained_steps=2)
    assert "| step 2 (trained) | 0.500 | 1.000 | 0.667 | 0.667 |" in table
    assert "| step 3 | 1.000 | 1.000 | 1.000 | 1.000 |" in table
    assert table.endswith("| one reply to every question, at best | 0.500 | 1.000 | | |")
    json.dumps(result)  # JSON-ready


def test_items_come_from_the_built_tasks_or_conversations_ending_with_the_answer(tmp_path):
    items = chat_eval.items_from("builtin", limit=4)
    assert [t for t, _ in items] == ["arithmetic", "hops"] * 4
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"messages": qa("q", "a")}) + "\n")
    assert chat_eval.items_from(str(path)) == [(str(path), qa("q", "a"))]
    path.write_text(json.dumps({"messages": qa("q", "a") + [{"role": "user", "content": "and?"}]}) + "\n")
    with pytest.raises(chat.ChatDataError, match="conversation 1 does not end with the assistant's answer"):
        chat_eval.items_from(str(path))
    with pytest.raises(chat.ChatDataError, match="no conversations to evaluate"):
        chat_eval.evaluate_chat(None, TOK, [], 2)
