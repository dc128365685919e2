"""Tests for the Hugging Face export: transformers loads the exported directory and computes what our model does."""

import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.dynamic_module_utils import get_imports

from nanochat.checkpoint.manager import load_model
from nanochat.data.tokenizer import SPECIAL_TOKENS, RustBPETokenizer
from nanochat.model import gpt
from nanochat.model.engine import Engine
from nanochat.model.gpt import ACTIVATIONS, STATE_UPDATES, GPTConfig
from scripts import export_hf
from tests.support import forked
from tests.support.helpers import ROOT, random_model
from tests.support.tiny_checkpoint import MODEL_TAG, tiny_checkpoint
from tests.support.unwritable import FULL, READ_ONLY, dead_pid, fail_writes, one_line

ATOL = 1e-4
SAMPLE = ("def refine(y, z):\n    return y + z  # 平方根 √2 ≈ 1.414\n\n\tclass Ünïcödé: pass\r\n"
          "naïve café, 日本語のテキスト, العربية, Ελληνικά 😀👩‍👩‍👧 don't WE'LL 12345 0xFF  \n  end")

# GPTConfig options exported and compared at every supervision-step setting; add new options here.
CONFIG_OPTIONS = [
    dict(n_loops=0),
    dict(n_loops=1),
    dict(n_loops=2),
    dict(n_loops=1, T_recursion=2),
    *[dict(activation_fn=fn) for fn in ACTIVATIONS],
    *[dict(n_loops=1, T_recursion=2, state_update=update) for update in STATE_UPDATES],
    dict(n_loops=1, n_prelude=1, n_coda=2, halt_head=True),
    dict(n_loops=0, n_prelude=2),
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def base_dir(trained):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(trained[0]))
        yield trained[0]


@pytest.fixture(scope="module")
def exported(base_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "tiny-hf"
    assert export_hf.main(["--model_tag", MODEL_TAG, "--step", "best", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def hf(exported):
    return AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True).eval()


def test_the_export_holds_weights_config_code_and_tokenizer(exported, base_dir):
    files = set(os.listdir(exported))
    assert {"model.safetensors", "config.json", "hf_model.py", "gpt.py", "tokenizer.json", "README.md"} <= files
    with open(gpt.__file__, "rb") as f:
        assert (exported / "gpt.py").read_bytes() == f.read()  # the recursion is written once, in gpt.py
    _, _, meta = load_model(MODEL_TAG, "best")
    assert meta["step"] == 20  # "best", not "latest"
    config = json.loads((exported / "config.json").read_text())
    assert {k: config[k] for k in meta["model_config"]} == meta["model_config"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "hf_model.NanochatTRMForCausalLM"


def test_the_exported_code_needs_only_torch_and_transformers(exported):
    """What transformers' remote-code loader demands that a user of the exported directory has installed."""
    imports = {name for path in exported.glob("*.py") for name in get_imports(path)}
    assert imports - sys.stdlib_module_names == {"torch", "transformers"}


@torch.no_grad()
def test_transformers_logits_equal_ours_at_every_supervision_step(hf, base_dir):
    model, _, _ = load_model(MODEL_TAG, "best")
    idx = torch.randint(0, model.config.vocab_size, (2, model.config.sequence_len),
                        generator=torch.Generator().manual_seed(0))
    assert hf.config.n_sup_inference == model.config.n_sup_inference == 3
    for n_sup in range(1, model.config.n_sup_inference + 1):
        ours = model(idx, n_sup=n_sup)
        theirs = hf(input_ids=idx, n_sup=n_sup).logits
        assert (theirs - ours).abs().max() <= ATOL, f"n_sup={n_sup}"
    torch.testing.assert_close(hf(idx).logits, model(idx), atol=ATOL, rtol=0)  # default: n_sup_inference


@pytest.mark.parametrize("options", CONFIG_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@torch.no_grad()
def test_every_config_option_round_trips(options, trained, tmp_path):
    _, _, tokenizer = trained
    config = GPTConfig(sequence_len=16, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=4, n_kv_head=2,
                       n_embd=32, n_sup_train=3, **options)
    model = random_model(config, every_weight=True)
    meta = {"step": 1, "model_config": config.to_dict(), "val_bpb": None}
    export_hf.write_export(model, tokenizer, meta, "random", str(tmp_path / "out"))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    assert hf.model.config.to_dict() == config.to_dict()
    idx = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    for n_sup in range(1, config.n_sup_inference + 1):
        ours = model(idx, n_sup=n_sup)
        assert ours.std() > 0.3  # random weights: a wrong recursion cannot match by accident
        assert (hf(input_ids=idx, n_sup=n_sup).logits - ours).abs().max() <= ATOL, f"n_sup={n_sup}"


@torch.no_grad()
def test_loss_with_labels_is_the_last_steps_next_token_loss(hf, base_dir):
    model, _, _ = load_model(MODEL_TAG, "best")
    idx = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(2))
    expected = model(idx[:, :-1], idx[:, 1:], loss_reduction="none")[-1].mean()
    torch.testing.assert_close(hf(input_ids=idx, labels=idx).loss, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_generate_continues_like_the_engine(hf, trained, base_dir):
    model, tokenizer, _ = load_model(MODEL_TAG, "best")
    prompt = Engine(model, tokenizer).encode_prompt("the cat sat")
    ours = Engine(model, tokenizer).generate_batch([prompt], max_tokens=10, temperature=0.0)[0]
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0].tolist()
    assert out[:len(prompt)] == prompt and out[len(prompt):] == ours and len(ours) == 10
    with pytest.raises(ValueError, match="padding is not supported"):
        hf(input_ids=torch.tensor([prompt, prompt]), attention_mask=torch.tensor([[0] + [1] * (len(prompt) - 1)] * 2))


def check_tokenizer(hf_tok, tokenizer, text):
    bos = tokenizer.get_bos_token_id()
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode()) * 0.9  # merges were applied: the comparison is not byte by byte
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert hf_tok(text).input_ids == [bos] + ids  # <|bos|> first, as the Engine prompts the model
    assert hf_tok.decode([bos] + ids, skip_special_tokens=True) == text
    assert hf_tok.convert_tokens_to_ids(SPECIAL_TOKENS) == [tokenizer.encode_special(t) for t in SPECIAL_TOKENS]
    assert hf_tok.bos_token_id == hf_tok.eos_token_id == bos


def test_autotokenizer_gives_our_ids_on_the_exported_vocabulary(exported, trained):
    hf_tok = AutoTokenizer.from_pretrained(exported, trust_remote_code=True)
    check_tokenizer(hf_tok, trained[2], SAMPLE + "\nthe cat sat on the mat. the dog sat on the log.")


def test_autotokenizer_gives_our_ids_on_a_larger_mixed_vocabulary(tmp_path):
    code = [open(module.__file__, encoding="utf-8").read() for module in (json.decoder, os, pytest)]
    tokenizer = RustBPETokenizer.train_from_iterator(iter(code + [SAMPLE * 20]), 1500)
    export_hf.hf_tokenizer(tokenizer, model_max_length=64).save_pretrained(tmp_path)
    check_tokenizer(AutoTokenizer.from_pretrained(tmp_path), tokenizer, SAMPLE)


def run_export(capsys, *argv):
    code = export_hf.main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--model_tag", "missing"], "no checkpoint found for model tag 'missing'"),
    (["--model_tag", MODEL_TAG, "--step", "999"], "no checkpoint at step 999"),
])
def test_a_bad_checkpoint_is_one_line_and_writes_nothing(base_dir, tmp_path, capsys, argv, message):
    code, err = run_export(capsys, *argv, "--out", str(tmp_path / "out"))
    assert code == 2 and message in err and err.count("\n") == 1
    assert os.listdir(tmp_path) == []


def test_a_step_that_is_not_a_number_is_refused(base_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        export_hf.main(["--model_tag", MODEL_TAG, "--step", "abc", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "'abc': use 'latest', 'best' or a step number" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_an_existing_directory_is_replaced_only_with_force_and_only_if_it_is_an_export(base_dir, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    for argv in ([], ["--force"]):
        code, err = run_export(capsys, "--model_tag", MODEL_TAG, "--out", str(mine), *argv)
        assert code == 2 and err.count("\n") == 1 and ("--force" in err)
        assert os.listdir(mine) == ["notes.txt"] and sorted(os.listdir(tmp_path)) == ["mine"]

    out = tmp_path / "out"
    assert run_export(capsys, "--model_tag", MODEL_TAG, "--step", "20", "--out", str(out))[0] == 0
    code, err = run_export(capsys, "--model_tag", MODEL_TAG, "--step", "40", "--out", str(out))
    assert code == 2 and "pass --force to replace" in err
    assert run_export(capsys, "--model_tag", MODEL_TAG, "--step", "40", "--out", str(out), "--force")[0] == 0
    assert "step 40" in (out / "README.md").read_text()
    assert sorted(os.listdir(tmp_path)) == ["mine", "out"]  # no temporary or old directory left behind


def test_without_transformers_the_export_says_what_to_install(tmp_path):
    hide = ("import runpy, sys; sys.modules['transformers'] = None; "
            "runpy.run_module('scripts.export_hf', run_name='__main__')")
    result = forked.run([sys.executable, "-c", hide, "--out", str(tmp_path / "out")], timeout=60, cwd=ROOT)
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install -e '.[hf]'" in result.stderr and os.listdir(tmp_path) == []


def test_the_export_log_has_no_progress_bars_off_a_terminal(base_dir, tmp_path, capsys):
    assert export_hf.main(["--model_tag", MODEL_TAG, "--out", str(tmp_path / "quiet-hf")]) == 0
    out, err = capsys.readouterr()
    assert "exported" in out and "\r" not in out + err and "it/s" not in out + err


def full_disk_for_safetensors(mp):
    """What safetensors raises when the disk fills up under it (seen on a full tmpfs): its own type, not an OSError."""
    from safetensors import SafetensorError

    def save_file(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    mp.setattr("transformers.modeling_utils.safe_save_file", save_file)


@pytest.mark.parametrize("code", [FULL, READ_ONLY], ids=["full", "read-only"])
def test_an_export_that_cannot_be_written_is_one_line_exit_5_and_leaves_nothing(base_dir, tmp_path, capsys, code):
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit) as stop:
        if code == FULL:
            full_disk_for_safetensors(mp)
        else:
            fail_writes(mp, tmp_path, code)
        export_hf.main(["--model_tag", MODEL_TAG, "--out", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 5 and one_line(err)
    reason = "no space left on device; free space on that disk" if code == FULL else "read-only file system"
    assert err.startswith(f"export_hf: cannot write {out}: {reason}") and err.endswith(", or pick another --out\n")
    assert os.listdir(tmp_path) == []  # no out.tmpPID


def test_the_next_export_removes_what_a_killed_export_left_and_only_that(base_dir, tmp_path, capsys):
    out = tmp_path / "out"
    killed, running = tmp_path / f"out.tmp{dead_pid()}", tmp_path / f"out.tmp{os.getppid()}"
    for half in (killed, running):
        half.mkdir()
        (half / "model.safetensors").write_bytes(b"half written")
    assert export_hf.main(["--model_tag", MODEL_TAG, "--out", str(out)]) == 0
    assert f"removed 1 temporary file(s) left by stopped processes: {killed}" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["out", running.name]
