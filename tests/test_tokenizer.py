"""BPE tokenizer: round trips, special tokens, save/load, token byte lengths, and the training scripts."""

import json
import os
import re

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from nanochat.data import dataset
from nanochat.data.tokenizer import (
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    RustBPETokenizer,
    TokenizerError,
    TokenizerNotFound,
    get_token_bytes,
    get_tokenizer,
    tokenizer_dir,
    train_bpe,
)
from scripts import tok_eval, tok_train
from tests.support.helpers import stderr_capture

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "def add(a, b):\n    return a + b\n\n\nprint(add(12345, 678))\n" * 10,
    "Größe, naïve café — 日本語のテキスト, 한국어 문장, emoji 🙂🙃, tabs\t\tand  spaces.\n" * 10,
]
WHITESPACE = st.text(alphabet=" \t\n\r\x0b\x0c\u00a0\u2003\u3000", max_size=300)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)


@pytest.fixture(scope="session")
def bpe():
    return train_bpe(iter(TRAIN_TEXT), 400)


@pytest.fixture(scope="session")
def tok(bpe):
    return RustBPETokenizer.from_rustbpe(bpe)


def test_vocab_holds_merges_then_special_tokens(tok):
    assert tok.get_vocab_size() == 400
    ids = [tok.encode_special(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(400 - len(SPECIAL_TOKENS), 400))
    assert tok.get_bos_token_id() == ids[0]
    assert [tok.decode([i]) for i in ids] == SPECIAL_TOKENS


def test_training_split_pattern_is_the_encoding_pattern(bpe, tok):
    # training and encoding must cut text at the same places, or learned merges go unused at encode time
    assert bpe.get_pattern() == SPLIT_PATTERN == tok.pattern
    for text in TRAIN_TEXT + ["digits 1234567 and 'll 've  \n\n x", "unseen Ωmega words 99"]:
        assert bpe.encode(text) == tok.encode(text)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200) | WHITESPACE)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=50), max_size=8))
def test_batch_encode_matches_single(tok, texts):
    assert tok.encode(texts, num_threads=2) == [tok.encode(text) for text in texts]


def test_empty_string(tok):
    assert tok.encode("") == []
    assert tok.encode("", prepend="<|bos|>") == [tok.get_bos_token_id()]
    assert tok.decode([]) == ""


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(codec=None, categories=["Cs"]) | st.characters(), max_size=50))
def test_lone_surrogates_become_replacement_characters(tok, text):
    # documented: what tiktoken does, a lone surrogate becomes U+FFFD and a high+low pair the character it encodes
    expected = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert tok.decode(tok.encode(text)) == expected


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=100) | st.sampled_from(SPECIAL_TOKENS).map(lambda s: f"x{s}y"))
def test_ordinary_text_never_yields_special_tokens(tok, text):
    special = {tok.encode_special(name) for name in SPECIAL_TOKENS}
    assert not special & set(tok.encode(text))


def test_prepend_by_name_or_id(tok):
    bos = tok.get_bos_token_id()
    assert tok.encode("hi", prepend="<|bos|>") == tok.encode("hi", prepend=bos) == [bos] + tok.encode("hi")
    assert tok.encode(["a", "b"], prepend=bos) == [[bos] + tok.encode("a"), [bos] + tok.encode("b")]


def test_save_and_load_give_identical_encodings(tok, tmp_path):
    tok.save(tmp_path / "tok")
    tok.save(tmp_path / "tok")  # overwriting swaps the directory in whole
    loaded = RustBPETokenizer.from_directory(tmp_path / "tok")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
    for text in TRAIN_TEXT + ["brand new text 🙂", ""]:
        assert loaded.encode(text) == tok.encode(text)
    assert loaded.get_vocab_size() == tok.get_vocab_size()


def test_missing_tokenizer_says_how_to_train(tmp_path):
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "none", tmp_path / "empty"):
        with pytest.raises(TokenizerNotFound, match=r"no tokenizer at .*tokenizer.json; train one .*scripts.tok_train"):
            RustBPETokenizer.from_directory(directory)
    assert issubclass(TokenizerNotFound, FileNotFoundError) and issubclass(TokenizerNotFound, TokenizerError)


CORRUPT = {
    "empty file": b"",
    "truncated": b'{"pattern": "x", "tok',
    "not an object": b"[1, 2]",
    "binary": bytes(range(256)),
    "no tokens": b'{"pattern": "x"}',
    "bad base64": b'{"pattern": "x", "tokens": ["!!"]}',
    "missing bytes": b'{"pattern": "x", "tokens": ["YQ=="]}',
    "bad pattern": b'{"pattern": "(", "tokens": []}',
}


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_tokenizer_names_its_file(case, tok, tmp_path, monkeypatch, capsys):
    tok.save(tmp_path / "base" / "tokenizer")
    path = tmp_path / "base" / "tokenizer" / "tokenizer.json"
    content = CORRUPT[case]
    if case == "bad pattern":  # every byte present, only the pattern broken
        content = path.read_bytes().replace(json.dumps(tok.pattern).encode(), b'"("')
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=rf"{re.escape(str(path))} is not a readable tokenizer .*tok_train"):
        get_tokenizer()
    assert issubclass(TokenizerError, ValueError)  # base_loss, base_sample and serve print ValueErrors as one line
    assert tok_eval.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path} is not a readable tokenizer") and len(err.splitlines()) == 1


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_token_bytes_sum_to_utf8_length(tok, text):
    token_bytes = get_token_bytes(tokenizer=tok)
    ids = tok.encode(text, prepend="<|bos|>")
    assert int(token_bytes[ids].sum()) == len(text.encode("utf-8"))


def test_token_bytes_shape_and_specials(tok):
    token_bytes = get_token_bytes(tokenizer=tok)
    assert token_bytes.shape == (tok.get_vocab_size(),)
    assert (token_bytes[:256] == 1).all() and (token_bytes[-len(SPECIAL_TOKENS):] == 0).all()


def test_vocab_out_of_range_is_refused():
    for vocab_size in (100, 2 ** 20 + 1):
        with pytest.raises(TokenizerError, match="vocab_size must be between 265 .* and 1,048,576"):
            train_bpe(iter(TRAIN_TEXT), vocab_size)


# -----------------------------------------------------------------------------
# scripts

def test_tok_train_without_shards_names_the_command(capsys):
    assert tok_train.main(["--vocab_size", "300"]) == 1
    assert "python -m nanochat.dataset --builtin" in capsys.readouterr().err


@pytest.fixture
def shards(tmp_path):
    for i, text in enumerate(TRAIN_TEXT * 3):
        (tmp_path / f"doc{i}.txt").write_text(f"{i} {text}")
    dataset.import_corpus([str(tmp_path)])


def test_tok_train_then_eval(shards, monkeypatch, capsys):
    assert tok_train.main(["--vocab_size", "300", "--doc_cap", "200", "--max_chars", "1000"]) == 0
    out = capsys.readouterr().out
    assert "MB/s" in out and "vocab size 300" in out

    def offline(name):
        raise ConnectionError("offline")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert tok_eval.main([]) == 0
    out = capsys.readouterr().out
    assert "gpt2 (gpt2) is not available offline" in out
    assert [line.split()[0] for line in out.splitlines()[-2:]] == ["train", "val"]
    assert tok_eval.main(["--references=none"]) == 0  # the offline pipeline's call: nothing fetched, ours alone
    out = capsys.readouterr().out
    assert "not available" not in out and "gpt2" not in out and "ours (300)" in out
    with pytest.raises(SystemExit):
        tok_eval.main(["--references=gpt5"])
    assert "--references=gpt5: unknown gpt5; use gpt2, gpt4 or none" in capsys.readouterr().err


def test_fingerprint_changes_with_the_merges_and_not_with_the_object(tmp_path):
    from nanochat.data.tokenizer import RustBPETokenizer
    texts = ["the cat sat on the mat", "a dog ran to the log"] * 20
    a = RustBPETokenizer.train_from_iterator(iter(texts), 300)
    a.save(str(tmp_path / "a"))
    again = RustBPETokenizer.from_directory(str(tmp_path / "a"))
    other = RustBPETokenizer.train_from_iterator(iter(texts + ["zebra zebra zebra quartz"] * 30), 300)
    assert len(a.fingerprint()) == 16
    assert again.fingerprint() == a.fingerprint()
    assert other.fingerprint() != a.fingerprint()


def snapshot_base():
    """Every file under the base directory with its content, to prove nothing changed."""
    base = os.environ["NANOCHAT_BASE_DIR"]
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(base) for f in fs}


TOK_TRAIN_BAD = {
    "vocab 100": (["--vocab_size", "100"], "vocab_size must be between 265"),
    "vocab 0": (["--vocab_size", "0"], "vocab_size must be between 265"),
    "vocab -5": (["--vocab_size", "-5"], "vocab_size must be between 265"),
    "vocab 99999999999": (["--vocab_size", "99999999999"], "and 1,048,576, got 99999999999"),
    "doc_cap 0": (["--vocab_size", "512", "--doc_cap", "0"], "--doc_cap must be at least 1, got 0"),
    "max_chars 0": (["--vocab_size", "300", "--max_chars", "0"], "--max_chars must be at least 1, got 0"),
    "text too small": (["--vocab_size", "5000"], r"yields only \d+ tokens, not the 5,000 asked for.*Nothing was saved"),
}


@pytest.mark.parametrize("case", TOK_TRAIN_BAD)
@pytest.mark.parametrize("existing", [False, True])
def test_tok_train_bad_values_give_one_line_and_write_nothing(case, existing, shards, tok, capsys):
    if existing:
        tok.save(tokenizer_dir())
    before = snapshot_base()
    args, message = TOK_TRAIN_BAD[case]
    assert tok_train.main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and re.search(message, err), err
    assert snapshot_base() == before


def fake_checkpoint(tag, step, fingerprint):
    directory = os.path.join(os.environ["NANOCHAT_BASE_DIR"], "base_checkpoints", tag, f"step_{step:06d}")
    os.makedirs(directory)
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump({"step": step, "tokenizer_fingerprint": fingerprint}, f)


def test_tok_train_refuses_to_replace_a_tokenizer_checkpoints_depend_on(shards, tok, capsys):
    tok.save(tokenizer_dir())
    fake_checkpoint("d4", 10, tok.fingerprint())
    fake_checkpoint("d4", 20, tok.fingerprint())
    fake_checkpoint("8xH100_fast", 5, tok.fingerprint())
    fake_checkpoint("other", 5, "0123456789abcdef")  # trained with another tokenizer: not this one's dependent
    before = snapshot_base()
    assert tok_train.main(["--vocab_size", "300"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tokenizer_dir()} is the tokenizer of the checkpoints of 8xH100_fast, d4: ")
    assert "--force" in err and len(err.splitlines()) == 1
    assert snapshot_base() == before
    assert tok_train.main(["--vocab_size", "300", "--force"]) == 0
    assert "warning: --force: replacing the tokenizer" in capsys.readouterr().out
    assert get_tokenizer().fingerprint() != tok.fingerprint()


def test_tok_train_replaces_a_tokenizer_no_checkpoint_uses(shards, tok):
    tok.save(tokenizer_dir())
    fake_checkpoint("other", 5, "0123456789abcdef")
    assert tok_train.main(["--vocab_size", "300"]) == 0
    assert get_tokenizer().get_vocab_size() == 300


def test_tok_train_names_an_unreadable_shard(shards, capsys):
    path = dataset.parquets_for_split("train")[0]
    with open(path, "r+b") as f:
        f.truncate(100)
    before = snapshot_base()
    assert tok_train.main(["--vocab_size", "300"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: unreadable shard") and len(err.splitlines()) == 1
    assert snapshot_base() == before


@pytest.mark.parametrize("terminal, shown", [(True, True), (False, False)])
def test_tok_train_shows_progress_on_a_terminal_only(terminal, shown, shards, monkeypatch):
    stderr = stderr_capture(monkeypatch, terminal)
    assert tok_train.main(["--vocab_size", "300"]) == 0
    assert ("documents fed: 100%" in stderr.getvalue()) == shown


# -----------------------------------------------------------------------------
# the byte-level vocabulary: 256 byte tokens, the special tokens, no merges

MIXED = ["日本語のテキスト 한국어 中文", "emoji 🙂👩‍👩‍👧🏳️‍🌈", "combining: e\u0301 a\u0308 n\u0303 Z\u0336\u0335",
         "def f(x):\n\treturn {'k': [x ** 2 for x in range(10)]}  # ≤ ≠\r\n", "\x00\x7f\u200b\ufeff", ""]


@pytest.fixture(scope="session")
def byte_tok():
    return RustBPETokenizer.byte_level()


@pytest.mark.parametrize("text", MIXED)
def test_byte_level_ids_are_the_utf8_bytes_and_round_trip(byte_tok, text):
    ids = byte_tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert byte_tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_byte_level_round_trip(byte_tok, text):
    assert byte_tok.decode(byte_tok.encode(text)) == text


def test_byte_level_vocab_is_the_bytes_then_the_special_tokens(byte_tok):
    assert byte_tok.get_vocab_size() == 256 + len(SPECIAL_TOKENS)
    assert [byte_tok.encode_special(name) for name in SPECIAL_TOKENS] == list(range(256, 256 + len(SPECIAL_TOKENS)))
    token_bytes = get_token_bytes(tokenizer=byte_tok)
    assert token_bytes.tolist() == [1] * 256 + [0] * len(SPECIAL_TOKENS)


def test_byte_level_bits_per_byte_are_bits_per_token(byte_tok):
    """A model with every logit equal spends log2(vocab) bits on every token, and here every token is one byte."""
    import math

    import torch

    from nanochat.eval.loss_eval import evaluate_bpb
    from nanochat.model.gpt import GPT
    from tests.support.helpers import tiny_config
    model = GPT(tiny_config(vocab_size=byte_tok.get_vocab_size(), sequence_len=64))
    model.init_weights()  # zero lm_head: equal logits
    ids = torch.tensor(byte_tok.encode(" ".join(MIXED), prepend="<|bos|>"))[:65]
    batches = iter([(ids[None, :-1], ids[None, 1:])])
    bpb, _ = evaluate_bpb(model, batches, 1, get_token_bytes(tokenizer=byte_tok))
    assert bpb == pytest.approx([math.log2(byte_tok.get_vocab_size())] * model.config.n_sup_train, abs=1e-6)


def test_byte_level_saves_loads_and_has_its_own_fingerprint(byte_tok, tok, tmp_path):
    byte_tok.save(tmp_path / "tok")
    loaded = RustBPETokenizer.from_directory(tmp_path / "tok")
    assert loaded.fingerprint() == byte_tok.fingerprint() != tok.fingerprint()
    assert loaded.encode(MIXED[1]) == byte_tok.encode(MIXED[1])


def test_byte_level_export_gives_autotokenizer_our_ids(byte_tok, tmp_path):
    from transformers import AutoTokenizer

    from scripts.export_hf import hf_tokenizer
    hf_tokenizer(byte_tok, model_max_length=64).save_pretrained(tmp_path)
    hf_tok = AutoTokenizer.from_pretrained(tmp_path)
    bos = byte_tok.get_bos_token_id()
    for text in MIXED:
        assert hf_tok.encode(text, add_special_tokens=False) == byte_tok.encode(text), text
        assert hf_tok(text).input_ids == [bos] + byte_tok.encode(text)
        assert hf_tok.decode([bos] + byte_tok.encode(text), skip_special_tokens=True) == text
    assert hf_tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [byte_tok.encode_special(t) for t in SPECIAL_TOKENS]


def test_tok_train_byte_level_needs_no_shards(byte_tok, capsys):
    assert tok_train.main(["--byte_level"]) == 0
    assert f"vocab size {byte_tok.get_vocab_size()}, fingerprint {byte_tok.fingerprint()}" in capsys.readouterr().out
    assert get_tokenizer().fingerprint() == byte_tok.fingerprint()


def test_tok_train_byte_level_refuses_a_vocab_size_and_writes_nothing(capsys):
    before = snapshot_base()
    assert tok_train.main(["--byte_level", "--vocab_size", "300"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --byte_level has a fixed vocabulary (265 tokens); drop --vocab_size"
    assert snapshot_base() == before


def test_tok_train_byte_level_refuses_to_replace_a_tokenizer_checkpoints_depend_on(tok, capsys):
    tok.save(tokenizer_dir())
    fake_checkpoint("d4", 10, tok.fingerprint())
    assert tok_train.main(["--byte_level"]) == 1
    assert "is the tokenizer of the checkpoints of d4" in capsys.readouterr().err
    assert get_tokenizer().fingerprint() == tok.fingerprint()


@pytest.mark.parametrize("text", [" " * 1_000_000, "a" + " \t" * 500_000 + "b", "x" + "\u3000" * 1_000_000 + "y"])
def test_a_megabyte_of_whitespace_encodes_and_trains_without_a_panic(tok, text):
    """The split pattern's lookahead overflowed the Rust regex stack on such runs: tiktoken and rustbpe panicked."""
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode([text, "hi"])[0]) == text
    trained = RustBPETokenizer.from_rustbpe(train_bpe(iter([text, *TRAIN_TEXT]), 300))
    assert trained.decode(trained.encode(text)) == text


def test_text_without_long_whitespace_runs_encodes_as_tiktoken_alone_does(tok):
    text = "".join(TRAIN_TEXT) + " " * 9_999 + "end"
    assert tok.encode(text) == tok.enc.encode_ordinary(text)
