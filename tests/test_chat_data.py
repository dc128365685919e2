"""Conversations for chat_sft (nanochat/data/chat.py, chat_tasks.py): checking, rendering with the chat tokens and the
assistant-only mask, .jsonl and hf: reading with errors that name the line, packing with exact resume, the built set."""

import json
import re
import string

import pytest
import torch

from nanochat.data import chat, chat_tasks
from nanochat.data.dataloader import UNSCORED
from nanochat.data.tokenizer import RustBPETokenizer

TOK = RustBPETokenizer.byte_level()  # every byte a token: the ids below are readable


def special(name):
    return TOK.encode_special(name)


def text(s):
    return TOK.encode(s)


def conv(*turns, system=None):
    roles = ["user", "assistant"]
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def test_rendering_uses_the_chat_tokens_and_scores_the_assistant_and_its_end_only():
    ids, mask = chat.render_conversation(TOK, conv("hi", "yo", "ok?", "no", system="be brief"))
    expected = ([TOK.get_bos_token_id(), special("<|user_start|>")] + text("be brief\n\nhi") +
                [special("<|user_end|>"), special("<|assistant_start|>")] + text("yo") +
                [special("<|assistant_end|>"), special("<|user_start|>")] + text("ok?") +
                [special("<|user_end|>"), special("<|assistant_start|>")] + text("no") + [special("<|assistant_end|>")])
    assert ids == expected
    scored = [i for i, m in zip(ids, mask) if m]
    assert scored == text("yo") + [special("<|assistant_end|>")] + text("no") + [special("<|assistant_end|>")]
    assert len(mask) == len(ids)
    # the prompt a model answers from: the conversation up to the user's turn, then <|assistant_start|>
    assert chat.render_prompt(TOK, conv("hi", "yo", "ok?", system="be brief")) == \
        expected[:expected.index(special("<|assistant_end|>")) + 1 + 1 + len(text("ok?")) + 2]
    # the threaded batch renders exactly as one at a time
    many = [conv("a", "b"), conv("c", "d", "e", "f", system=""), conv("x" * 50, "y")]
    assert list(chat.render_many(TOK, many)) == [chat.render_conversation(TOK, c) for c in many]


@pytest.mark.parametrize("record, problem", [
    ([], "a JSON list where an object"),
    ({"msgs": []}, 'no "messages" list'),
    ({"messages": []}, "not a non-empty list"),
    ({"messages": ["hi"]}, "message 0 is a str"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "message 0 has role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}]}, "message 0 (user) has no string content (got int)"),
    ({"messages": [{"role": "user"}]}, "has no string content (got NoneType)"),
    ({"messages": conv("a", "b") + [{"role": "system", "content": "s"}]}, "only the first message may be one"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "from the assistant, but the user is due"),
    ({"messages": conv("a", "b") + [{"role": "assistant", "content": "c"}]}, "from the assistant, but the user"),
    ({"messages": conv("a")}, "no assistant message"),
])
def test_a_malformed_conversation_is_named(record, problem):
    assert problem in chat.conversation_problem(record)


def test_well_formed_conversations_pass():
    for c in (conv("a", "b"), conv("a", "b", "c"), conv("a", "", system="s")):
        assert chat.conversation_problem({"messages": c, "extra": 1}) is None


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_jsonl_reads_every_conversation_and_a_bad_line_is_named(tmp_path):
    good = [{"messages": conv("q1", "a1")}, {"messages": conv("q2", "a2", system="s")}]
    path = write_jsonl(tmp_path / "chats.jsonl", [good[0], "", good[1]])
    assert chat.read_conversations(path) == [good[0]["messages"], good[1]["messages"]]
    for bad, problem in ((["{not json"], "line 3: not valid JSON"),
                         ([{"messages": conv("q")}], "line 3: no assistant message"),
                         ([{"messages": [{"role": "user", "content": ["parts"]}]}], "line 3: message 0 (user)")):
        path = write_jsonl(tmp_path / "bad.jsonl", [good[0], good[1], *bad, good[0]])
        with pytest.raises(chat.ChatDataError, match=re.escape(f"{path} {problem}")):
            chat.read_conversations(path)
    with pytest.raises(chat.ChatDataError, match="expected a .jsonl file"):
        chat.read_conversations(str(tmp_path / "chats.json"))
    with pytest.raises(chat.ChatDataError, match="cannot read it"):
        chat.read_conversations(str(tmp_path / "missing.jsonl"))
    with pytest.raises(chat.ChatDataError, match="no conversations"):
        chat.read_conversations(write_jsonl(tmp_path / "empty.jsonl", [""]))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"messages": "\xff"}\n')
    with pytest.raises(chat.ChatDataError, match="line 1: not valid JSON"):
        chat.read_conversations(str(tmp_path / "latin1.jsonl"))


def test_a_hugging_face_dataset_with_a_messages_column_reads_as_smoltalk_does(tmp_path):
    import datasets
    rows = [conv("q1", "a1"), conv("q2", "a2", "q3", "a3", system="s")]
    datasets.Dataset.from_dict({"messages": rows, "source": ["x", "y"]}).save_to_disk(str(tmp_path / "one"))
    assert chat.read_conversations(f"hf:{tmp_path / 'one'}") == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"messages": rows}),
                          "test": datasets.Dataset.from_dict({"messages": rows[:1]})}).save_to_disk(
        str(tmp_path / "splits"))
    assert chat.read_conversations(f"hf:{tmp_path / 'splits'}::test") == rows[:1]
    with pytest.raises(chat.ChatDataError, match="no split 'val'; it has train, test"):
        chat.read_conversations(f"hf:{tmp_path / 'splits'}::val")
    datasets.Dataset.from_dict({"text": ["a"]}).save_to_disk(str(tmp_path / "text"))
    with pytest.raises(chat.ChatDataError, match="no 'messages' column; its columns are: text"):
        chat.read_conversations(f"hf:{tmp_path / 'text'}")
    datasets.Dataset.from_dict({"messages": [rows[0], conv("only a question")]}).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(chat.ChatDataError, match=r"bad row 1: no assistant message"):
        chat.read_conversations(f"hf:{tmp_path / 'bad'}")
    with pytest.raises(chat.ChatDataError, match="expected hf:NAME"):
        chat.read_conversations("hf:a:b:c:d")


def rendered(n, seed=0):
    """n conversations of varied lengths, rendered."""
    import random
    rng = random.Random(seed)
    return chat.Rendered(chat.render_many(TOK, [conv("q" * rng.randint(1, 12), "a" * rng.randint(1, 8))
                                                for _ in range(n)]))


def test_rows_hold_whole_conversations_and_score_only_assistant_tokens():
    convs = rendered(12)
    ids, mask, at = chat.pack_rows(convs, list(range(12)), 0, 3, 40)
    x, y = chat.to_inputs_targets(ids, mask)
    assert x.shape == y.shape == (3, 39) and x.min() >= 0
    for row in range(3):
        tokens = [t for t in ids[row].tolist() if t != UNSCORED]
        starts = [i for i, t in enumerate(tokens) if t == TOK.get_bos_token_id()]
        assert starts[0] == 0  # every row starts at a conversation
        pieces = [tokens[a:b] for a, b in zip(starts, starts[1:] + [len(tokens)])]
        assert all(p in [c[0].tolist() for c in convs] for p in pieces)  # whole conversations only
    placed = sum(1 for row in ids.tolist() for t in row if t == TOK.get_bos_token_id())
    assert placed == at
    scored = y[y != UNSCORED]
    assert len(scored) and set(scored.tolist()) <= set(text("a")) | {special("<|assistant_end|>")}
    # a conversation longer than a row is cut to it; the next starts a new row
    long = list(chat.render_many(TOK, [conv("q", "a" * 100), conv("q", "b")]))
    ids, mask, at = chat.pack_rows(long, [0, 1], 0, 2, 30)
    assert at == 2 and ids[0].tolist() == long[0][0][:30] and ids[1, :len(long[1][0])].tolist() == long[1][0]


def test_the_loader_resumes_exactly_and_the_data_ranks_share_each_epoch():
    convs = rendered(15)
    straight = chat.ChatLoader(convs, 2, 32, 0, 1, seed=3)
    batches = [next(straight) for _ in range(6)]
    again = chat.ChatLoader(convs, 2, 32, 0, 1, seed=3)
    for _ in range(3):
        next(again)
    resumed = chat.ChatLoader(convs, 2, 32, 0, 1, seed=3, resume_state=json.loads(json.dumps(again.state_dict())))
    for a, b in zip(batches[3:], [next(resumed) for _ in range(3)]):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert straight.state_dict()["epoch"] >= 1  # 6 batches of 15 short conversations run past an epoch
    shares = [chat.ChatLoader(convs, 2, 32, r, 3, seed=3).share(0) for r in range(3)]
    assert sorted(sum(shares, [])) == list(range(15))
    assert chat.ChatLoader(convs, 2, 32, 0, 1, seed=4).share(0) != straight.share(0)  # the seed shuffles
    with pytest.raises(ValueError, match="the conversations changed"):
        chat.ChatLoader(chat.Rendered(convs[i] for i in range(5)), 2, 32, 0, 1, seed=3,
                        resume_state={"epoch": 0, "index": 20})
    with pytest.raises(ValueError, match="not a chat loader's position"):
        chat.ChatLoader(convs, 2, 32, 0, 1, seed=3, resume_state={"epoch": 0, "shard": "x"})
    with pytest.raises(chat.ChatDataError, match="2 training conversations for 3 data ranks"):
        chat.ChatLoader(chat.Rendered(convs[i] for i in range(2)), 2, 32, 0, 3, seed=3)


def test_chat_data_holds_out_validation_and_leaves_out_what_could_never_train():
    convs = [conv(f"question {i}", f"answer {i}") for i in range(40)] + [conv("q" * 200, "too late")]
    data = chat.ChatData(TOK, 64, "test", convs, seed=0)
    assert len(data.val_conversations) == 2 and len(data.train_conversations) == 39
    assert not {json.dumps(c) for c in data.val_conversations} & {json.dumps(c) for c in data.train_conversations}
    assert len(data.train) == 38  # the long one: its answer lies beyond the 64-token row
    assert data.identity()["fingerprint"] == chat.ChatData(TOK, 64, "test", convs, seed=0).identity()["fingerprint"]
    assert data.identity()["fingerprint"] != chat.ChatData(TOK, 64, "test", convs[1:], seed=0).identity()["fingerprint"]
    assert all(p[-1] == special("<|assistant_start|>") for p in data.sample_prompts)
    make, steps = data.validation(TOK, 1, 64, 10_000, rank=0, world_size=2)
    other, steps_1 = data.validation(TOK, 1, 64, 10_000, rank=1, world_size=2)
    assert steps == steps_1 == 1
    ys = [y for _, y in make()] + [y for _, y in other()]
    assert sum(int((y != UNSCORED).sum()) for y in ys) == sum(sum(m[1:]) for _, m in data.val)
    with pytest.raises(chat.ChatDataError, match="no training conversation has an assistant token"):
        chat.ChatData(TOK, 16, "test", [conv("q" * 40, "a")] * 3, val=[conv("q", "a")])


def test_the_built_set_is_deterministic_and_its_answers_are_right():
    items = chat_tasks.builtin_items("test", count=50)
    assert items == chat_tasks.builtin_items("test", count=50)
    assert items != chat_tasks.builtin_items("train", count=50)
    assert [t for t, _ in items[:4]] == ["arithmetic", "hops", "arithmetic", "hops"]
    words = {w: i for i, w in enumerate(chat_tasks.NUMBER_WORDS)}
    for task, messages in items:
        assert chat.conversation_problem({"messages": messages}) is None
        question, answer = messages[-2]["content"], messages[-1]["content"]
        if task == "arithmetic":
            a, b = (words[w.lower()] for w in re.findall(r"\b(" + "|".join(words) + r")\b", question, re.I))
            assert words[answer] == a + b
        else:
            table, ask = question.split("\n")
            f = dict(pair.split(">") for pair in table.split())
            x, hops = re.fullmatch(r"Where does (\w) go after (\d) hops?\?", ask).groups()
            for _ in range(int(hops)):
                x = f[x]
            assert answer == x and set(f) == set(string.ascii_lowercase[:5])
    assert len(chat.read_conversations("builtin")) == chat_tasks.BUILTIN_SIZES["train"]
