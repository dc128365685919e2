"""
Supervised fine-tuning: a base checkpoint trained on conversations, every supervision step scored on the assistant's
tokens, with base_train's machinery (plan, budgets, run lock, exact --resume, checkpoints, metrics, plot).

    python -m scripts.chat_sft --model_tag=d12 --step=best --data=chats.jsonl           # OpenAI-style {"messages"}
    python -m scripts.chat_sft --model_tag=d12 --data=hf:HuggingFaceTB/smol-smoltalk    # a hub dataset's messages
    python -m scripts.chat_sft --model_tag=cpu_d4 --data=builtin --num_epochs=2         # the built set, offline
    torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft -- --model_tag=d12 --data=chats.jsonl

The result is an ordinary checkpoint under --sft_tag (default: <model_tag>_sft), with the base model's config (the
recursion settings included), so base_loss, base_sample, serve, export_hf and plot_run read it unchanged. Training
flags are base_train's (--num_iterations, --device_batch_size, --matrix_lr, --eval_every, --max_hours, --resume,
...); unset, the batch, learning rates and dtype are the base run's, with a warmdown over the second half. The model
flags are the base checkpoint's and cannot be changed here (but --n_sup_inference and --activation_checkpointing).
Conversations and their rendering: nanochat/data/chat.py; docs/chat.md.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import dataclasses
import math
import sys

from nanochat import checkpoint as ckpt
from nanochat.cli import DefaultsHelp, Exit, ExitCode, OneLineErrors
from nanochat.common import print0
from nanochat.data.chat import ChatDataError, load_chat_data
from nanochat.data.tokenizer import TokenizerError, get_tokenizer
from nanochat.files import model_tag_arg
from nanochat.model.gpt import GPTConfig
from nanochat.train.config import parse_args
from nanochat.train.planning import MODEL_FLAGS, plan_lines
from nanochat.trainer import Init, run_or_exit, train

SHAPE_FLAGS = {"depth": "n_layer", "n_embd": "n_embd", "n_head": "n_head", "n_kv_head": "n_kv_head",
               "max_seq_len": "sequence_len"}
CHANGEABLE = {"n_sup_inference", "activation_checkpointing"}  # change no weight and no training math
FIXED = (set(SHAPE_FLAGS) | set(MODEL_FLAGS) | {"preset"}) - CHANGEABLE
# training settings a fine-tuning run takes from the base run unless given
INHERITED = ("device_batch_size", "total_batch_size", "weight_decay", "grad_clip")
# nanochat's SFT schedule: no warmup, decay to the end; no step-count curriculum (the base model already runs them all)
SFT_DEFAULTS = {"warmup_ratio": 0.0, "warmdown_ratio": 0.5, "n_sup_warmup": 0.0}


def build_parser():
    p = OneLineErrors(prog="python -m scripts.chat_sft", allow_abbrev=False, formatter_class=DefaultsHelp,
                      description="Fine-tune a base checkpoint on conversations. Every other flag is base_train's "
                                  "(python -m scripts.base_train --help), the model flags excepted.",
                      epilog=f"Unset, these take the base run's values: --{', --'.join(INHERITED)} and the learning "
                             f"rates (as the base run applied them); and "
                             f"{', '.join(f'--{k}={v}' for k, v in SFT_DEFAULTS.items())} (no warmup, a warmdown over "
                             f"the second half, as nanochat's SFT); the model flags are the base checkpoint's.")
    ckpt.checkpoint_flags(p, "the base checkpoint to fine-tune")
    p.add_argument("--data", required=True,
                   help="conversations: a .jsonl file of {\"messages\": [...]} lines, hf:NAME[:config][:split] (a "
                        "dataset with a messages column), or builtin (the built set, nanochat/data/chat_tasks.py)")
    p.add_argument("--val_data", default=None,
                   help="validation conversations, in the same forms (default: 1 in 20 of --data, held out)")
    p.add_argument("--sft_tag", type=model_tag_arg, default=None,
                   help="the fine-tuned run's tag under base_checkpoints/ (default: <model_tag>_sft)")
    p.add_argument("--num_epochs", type=float, default=1.0,
                   help="passes over the training conversations, when --num_iterations is not given")
    return p


def flag_names(argv):
    """The flags named in argv (underscored, without values)."""
    return {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}


def base_flags(config, train_config, given):
    """base_train flags that rebuild the base run's model config exactly, and its training settings not in `given`."""
    flags = [f"--{flag}={config[field]}" for flag, field in SHAPE_FLAGS.items()]
    flags += [f"--{name}={config[name]}" for name in MODEL_FLAGS if name not in given]
    scale = train_config.get("lr_scale", 1.0)  # the base run's effective learning rates, for --total_batch_size
    flags += [f"--{name}={train_config[name] * scale}" for name in ("matrix_lr", "embedding_lr", "unembedding_lr")
              if name not in given and isinstance(train_config.get(name), (int, float))]
    flags += [f"--{name}={train_config[name]}" for name in INHERITED
              if name not in given and train_config.get(name) is not None]
    return flags + [f"--{name}={value}" for name, value in SFT_DEFAULTS.items() if name not in given]


def parse(argv):
    """(the run's RunConfig, this script's flags, the base checkpoint's (tag, step, meta)); errors exit with a line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # torchrun ... -m scripts.chat_sft -- --data=...
        argv = argv[1:]
    parser = build_parser()
    flags, rest = parser.parse_known_args(argv)
    fixed = sorted(FIXED & flag_names(rest))
    if fixed:
        parser.error(f"--{fixed[0]}: the model's config is the base checkpoint's (its recursion settings included), "
                     f"so a fine-tuning run keeps it; drop the flag (only --n_sup_inference and "
                     f"--activation_checkpointing may change)")
    if not flags.num_epochs > 0:
        parser.error(f"--num_epochs={flags.num_epochs} must be > 0")
    try:
        tag = flags.model_tag or ckpt.latest_model_tag()
        step = ckpt.resolve_step(tag, flags.step)
        meta = ckpt.read_meta(tag, step)
    except ckpt.CheckpointError as e:
        raise Exit(str(e), code=ExitCode.USAGE)
    sft_tag = flags.sft_tag or f"{tag}_sft"
    if sft_tag == tag:
        parser.error(f"--sft_tag={sft_tag} is the base checkpoint's tag: the fine-tuned run needs a tag of its own")
    config = GPTConfig.from_dict(meta["model_config"]).to_dict()
    given = flag_names(rest)
    run_config = parse_args(base_flags(config, meta.get("train_config") or {}, given) + rest +
                            [f"--model_tag={sft_tag}"])
    kept = {k: v for k, v in config.items() if k != "vocab_size"}
    changed = {k: (kept[k], v) for k, v in run_config.model_config.items() if k not in CHANGEABLE and kept[k] != v}
    if changed:  # the flags above rebuild it; a difference here is a bug, not a user's choice
        raise Exit(f"internal: the model config differs from the base checkpoint's: {changed}")
    model_config = {**kept, **{k: run_config.model_config[k] for k in CHANGEABLE}}
    origin = f"base checkpoint {tag} step {step}"
    sources = {k: run_config.config_sources[k] if k in CHANGEABLE and k in given else origin for k in model_config}
    # rows of whole conversations (data/chat.py packs them), and chat prompts for samples
    run_config = dataclasses.replace(run_config, model_config=model_config, config_sources=sources, samples=True,
                                     rows="documents")
    return run_config, flags, (tag, step, meta)


def initial_weights(tag, step, data_spec):
    """The base checkpoint's published weights, loaded (and checked) when a fresh run starts."""
    def load(model):
        base, _, _ = ckpt.load_model(tag, step, "cpu")
        model.load_state_dict(base.state_dict())
        print0(f"initial weights: {tag} step {step}")
    return Init({"model_tag": tag, "step": step, "data": data_spec}, load)


def fine_tune(argv):
    """The run: its flags parsed and its conversations read and checked before anything is written."""
    run_config, flags, (tag, step, meta) = parse(argv)
    try:
        tokenizer = get_tokenizer()
        ckpt.check_tokenizer(meta, tokenizer, f"checkpoint {tag} step {step}")
        data = load_chat_data(tokenizer, run_config.max_seq_len, flags.data, flags.val_data, run_config.seed)
    except (ChatDataError, TokenizerError, ckpt.CheckpointError) as e:
        raise Exit(str(e), code=ExitCode.USAGE)
    if run_config.num_iterations is None:
        per_epoch = data.steps_per_epoch(run_config)
        run_config = dataclasses.replace(run_config, num_iterations=max(1, math.ceil(flags.num_epochs * per_epoch)))
        print0(f"horizon: {flags.num_epochs:g} epoch(s) of {len(data.train):,} conversations, {per_epoch} steps each")
    print0(f"fine-tuning {tag} step {step} on {flags.data} into {run_config.model_tag}")
    if run_config.dry_run:
        print0("\n".join(plan_lines(run_config)) + "\n--dry_run: nothing was run or written")
        return
    train(run_config, data=data, init=initial_weights(tag, step, flags.data))


def main(argv=None):
    run_or_exit("chat_sft", lambda: fine_tune(argv))


if __name__ == "__main__":
    main()
