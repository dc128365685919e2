"""
Export a checkpoint as a Hugging Face transformers model directory.

python -m scripts.export_hf --model_tag d12 --step best --out d12-hf

DIR then holds model.safetensors, config.json (every GPTConfig field, and auto_map), generation_config.json,
hf_model.py + gpt.py + engine.py (the model code, run with trust_remote_code=True), tokenizer.json +
tokenizer_config.json and a README.md model card. It loads with

    model = AutoModelForCausalLM.from_pretrained("d12-hf", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained("d12-hf", trust_remote_code=True)  # it reads config.json too

The tokenizer puts <|bos|> in front of every text, as the model saw every document in training; generation stops at
any special token, as the server's does: the next <|bos|> (a base model starts a new document when it is done),
<|assistant_end|>, or one that opens another turn (nanochat/model/engine.py STOP_TOKENS). DIR is written into a
temporary directory and renamed into place; an existing non-empty DIR is only replaced with --force, and only if
it holds an earlier export.
"""

import glob
import json
import os
import shutil
import sys

import torch

from nanochat.checkpoint import checkpoint_flags, open_checkpoint
from nanochat.cli import ArgumentParser, ExitCode, install_command, missing_package
from nanochat.files import (
    exit_on_write_error,
    remove_stale_temporaries,
    temporary_path,
    write_error,
    write_failure,
    writing,
)

try:
    from tokenizers import normalizers, processors
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from nanochat.model.hf_model import NanochatTRMConfig, NanochatTRMForCausalLM
except ImportError as e:  # transformers missing, or older than 5
    reason = missing_package(e, "the export") if isinstance(e, ModuleNotFoundError) else \
        f"{e}; install the tested version with: {install_command('hf')}"
    sys.exit(f"error: {reason}")
from nanochat.data.chat import CHAT_TEMPLATE, TEXT_ESCAPE
from nanochat.data.tokenizer import SPECIAL_TOKENS
from nanochat.model.engine import STOP_TOKENS

ANOTHER_OUT = ", or pick another --out"  # the rest of a failed write's advice

NanochatTRMConfig.register_for_auto_class()  # writes auto_map into config.json and copies the code into DIR
NanochatTRMForCausalLM.register_for_auto_class("AutoModelForCausalLM")


class RanksConverter(TikTokenConverter):
    """transformers' tiktoken converter, given our ranks in memory instead of the path of a .tiktoken file."""

    @staticmethod
    def load_tiktoken_bpe(mergeable_ranks):
        return mergeable_ranks


def hf_tokenizer(tokenizer, model_max_length):
    """Our BPE (ranks, split pattern, special tokens) as a fast tokenizer that prepends <|bos|> like the Engine, with
    chat_sft's rendering as its chat template (apply_chat_template), in which message text is never a special token
    (the template escapes it, the normalizer undoes the escape: docs/chat.md)."""
    converted = RanksConverter(vocab_file=tokenizer.mergeable_ranks, pattern=tokenizer.pattern,
                               extra_special_tokens=SPECIAL_TOKENS).converted()
    converted.normalizer = unescape_message_text()
    bos = tokenizer.get_bos_token_id()
    converted.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=converted, bos_token="<|bos|>", eos_token="<|bos|>",
                                   model_max_length=model_max_length, chat_template=CHAT_TEMPLATE)


def unescape_message_text():
    """The normalizer that undoes the chat template's escape of message text (nanochat/data/chat.py MESSAGE_TEXT:
    every "<|" written "<" ESC "|", every ESC written twice). It runs after special tokens are matched in the raw text,
    so message text reaches the BPE as it was and is never a special token; the template's own markers are. In escaped
    text a run of ESCs is doubled (2k) or the escape's single one before "|": dropping one ESC before each "|", then
    halving the pairs, gives every run back (2k before "|" leaves 2k - 1: k - 1 pairs and one). Other text changes
    only where ESC, a noncharacter, stands before "|" or twice in a row."""
    return normalizers.Sequence([normalizers.Replace(TEXT_ESCAPE + "|", "|"),
                                 normalizers.Replace(TEXT_ESCAPE * 2, TEXT_ESCAPE)])


def hf_model(model, tokenizer):
    """Our loaded GPT inside the transformers wrapper (built on the meta device: no second copy of the weights)."""
    config = NanochatTRMConfig(**model.config.to_dict(), tie_word_embeddings=False,
                               bos_token_id=tokenizer.get_bos_token_id())
    with torch.device("meta"):
        wrapper = NanochatTRMForCausalLM(config)
    wrapper.model = model
    stops = [tokenizer.encode_special(name) for name in STOP_TOKENS]
    wrapper.generation_config = GenerationConfig(bos_token_id=stops[0], eos_token_id=stops, pad_token_id=stops[0])
    return wrapper


def model_card(model_tag, meta, directory):
    config = json.dumps(meta["model_config"], indent=2)
    return f"""---
library_name: transformers
tags: [nanochat-trm]
---
# {model_tag}, step {meta['step']}

A nanochat-TRM base model: a GPT with TRM recursive refinement and deep supervision, answering in
{meta['model_config']['n_sup_inference']} supervision steps. Validation bits per byte per step: {meta.get('val_bpb')}.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{directory}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{directory}", trust_remote_code=True)
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0], skip_special_tokens=True))
```

`model(ids, n_sup=s)` computes the first s supervision steps only. Model config:

```json
{config}
```
"""


def is_export(directory):
    try:
        with open(os.path.join(directory, "config.json")) as f:
            return json.load(f).get("model_type") == NanochatTRMConfig.model_type
    except (OSError, ValueError):
        return False


def check_out(out, force):
    """None if DIR may be written, else what is wrong with it."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out} is a file; give a directory"
    if not os.path.isdir(out) or not os.listdir(out):
        return None
    if not force:
        return f"--out {out} exists and is not empty; pass --force to replace an earlier export, or pick a new --out"
    if not is_export(out):
        return f"--out {out} holds files that are not an export of this project; --force replaces only an export"
    return None


def write_export(model, tokenizer, meta, model_tag, out):
    """Everything into out.tmpPID, then renamed into place: DIR is the old export or the new one, never half. A failed
    write removes out.tmpPID and raises WriteError; those of killed exports go first."""
    remove_stale_temporaries(glob.escape(out))
    tmp, old = temporary_path(out), f"{out}.old{os.getpid()}"
    from transformers.utils import logging as hf_logging  # lazy: beside its one use; transformers is loaded by now
    if not sys.stderr.isatty():  # transformers' own progress bar would fill log files, as ours never do
        hf_logging.disable_progress_bar()
    try:
        hf_model(model, tokenizer).save_pretrained(tmp)
        hf_tokenizer(tokenizer, model.config.sequence_len).save_pretrained(tmp)
        with open(os.path.join(tmp, "README.md"), "w") as f:
            f.write(model_card(model_tag, meta, os.path.basename(out)))
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and write_failure(e):  # safetensors' and tokenizers' own errors included
            raise write_error(out, e, ANOTHER_OUT) from e
        raise
    with writing(out, ANOTHER_OUT):
        if os.path.exists(out):
            os.rename(out, old)
        os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def parse_args(argv=None):
    parser = ArgumentParser(description="Export a checkpoint as a Hugging Face transformers model directory")
    checkpoint_flags(parser)
    parser.add_argument("--out", required=True, help="directory to write (created; see --force)")
    parser.add_argument("--force", action="store_true", help="replace an earlier export in --out")
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    problem = check_out(args.out, args.force)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        model, tokenizer, meta, model_tag, _ = open_checkpoint(args.model_tag, args.step, torch.device("cpu"))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return ExitCode.USAGE
    with exit_on_write_error("export_hf"):
        write_export(model, tokenizer, meta, model_tag, args.out)
    print(f"exported {model_tag} step {meta['step']} ({model.num_params():,} parameters) to {args.out}\n"
          f"load it with AutoModelForCausalLM.from_pretrained({args.out!r}, trust_remote_code=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
