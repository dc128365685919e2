"""The HF export's chat template: transformers' apply_chat_template renders exactly the ids chat_sft trains on
(nanochat/data/chat.py), the prompt the server answers from, and the assistant mask the loss falls on."""

import json
import os

import pytest
from transformers import AutoTokenizer

from nanochat.data import chat
from nanochat.data.chat_tasks import builtin_items
from nanochat.data.tokenizer import RustBPETokenizer
from scripts import export_hf

CONVERSATIONS = [
    [{"role": "user", "content": "What is three plus four?"}, {"role": "assistant", "content": "seven"}],
    [{"role": "system", "content": "You answer with one word."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": " Hello!  "}, {"role": "user", "content": "  and again,\n\n twice?\n"},
     {"role": "assistant", "content": "Sure: café, 日本語, 😀 don't\n"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"},
     {"role": "assistant", "content": ""}],
    *[messages for _, messages in builtin_items("test", count=3)],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(ours, transformers' from the exported files): a BPE with merges, so segment boundaries matter."""
    texts = [open(module.__file__, encoding="utf-8").read() for module in (json.decoder, os)]
    ours = RustBPETokenizer.train_from_iterator(iter(texts + [json.dumps(CONVERSATIONS, ensure_ascii=False) * 5]), 800)
    out = tmp_path_factory.mktemp("hf-tokenizer")
    export_hf.hf_tokenizer(ours, model_max_length=512).save_pretrained(out)
    return ours, AutoTokenizer.from_pretrained(out)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_apply_chat_template_renders_what_chat_sft_trains_on(tokenizers, index):
    ours, hf = tokenizers
    messages = CONVERSATIONS[index]
    ids, mask = chat.render_conversation(ours, messages)
    rendered = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert rendered["input_ids"] == ids
    assert rendered["assistant_masks"] == mask  # the {% generation %} spans are the tokens the loss falls on
    prompt = messages[:next(i for i, m in enumerate(messages) if m["role"] == "assistant")]
    assert hf.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"] \
        == chat.render_prompt(ours, prompt)


def test_the_template_is_in_the_exported_tokenizer_files(tokenizers, tmp_path):
    ours, _ = tokenizers
    export_hf.hf_tokenizer(ours, model_max_length=64).save_pretrained(tmp_path)
    saved = "".join(open(os.path.join(tmp_path, name), encoding="utf-8").read() for name in os.listdir(tmp_path)
                    if name.endswith((".json", ".jinja")))
    assert "<|assistant_start|>" in saved and "generation" in saved
