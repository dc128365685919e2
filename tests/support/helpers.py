"""What several test modules share: the repository root, tiny models, base_train's tiny flags and checkpoint paths,
process handling with a hang limit. Plain functions rather than conftest fixtures: tests call them with arguments
(a config's overrides, which weights to draw) and other helper modules (tiny_checkpoint.py) call them too."""

import contextlib
import io
import math
import os
import sys

import pyarrow.parquet as pq
import torch

from nanochat.model.gpt import GPT, GPTConfig
from tests.support import processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the repo

# ---------------------------------------------------------------------------------------------------- tiny models

# detach_between_steps=False, not the default: the model's tests take the full graph, gradients crossing every step
TINY_MODEL = dict(sequence_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                  n_loops=1, T_recursion=1, n_sup_train=2, detach_between_steps=False)


# ---------------------------------------------------------------------------------------------------- host syncs
SYNCING_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def host_index(index):
    """Whether an index is a Python list (or holds one): torch copies it to the device, a blocking copy on a GPU."""
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


@contextlib.contextmanager
def host_syncs():
    """A list that grows by one at every host sync a GPU would make here: every way a tensor's value reaches Python,
    and every index built on the host (a Python list)."""
    counted, saved = [], {}
    for name in SYNCING_READS + ("__getitem__", "__setitem__"):
        saved[name] = real = getattr(torch.Tensor, name)
        if name in SYNCING_READS:
            spy = lambda self, *a, _real=real, **k: counted.append(1) or _real(self, *a, **k)  # noqa: E731
        else:
            spy = lambda self, index, *a, _real=real: (  # noqa: E731
                counted.append(1) if host_index(index) else None) or _real(self, index, *a)
        setattr(torch.Tensor, name, spy)
    try:
        yield counted
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)


def tiny_config(**overrides):
    return GPTConfig(**{**TINY_MODEL, **overrides})


def random_model(config, seed=0, every_weight=False):
    """A GPT on which a test can fail: init_weights zeroes c_proj and lm_head, which makes every block the identity
    and every logit equal, so causality, gradient and cache tests would pass vacuously. every_weight=False draws only
    those zeroed weights (the rest keep init_weights' values); every_weight=True draws every weight anew."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if every_weight or not p.any():
                p.normal_(std=1.0 / math.sqrt(p.size(-1)))
    assert all(p.any() for p in model.parameters())
    return model


# ---------------------------------------------------------------------------------------------------- base_train

# A tiny model on the CPU, as parsing sees it (the total batch left at its default)...
TINY_SHAPE = ["--depth=1", "--n_embd=32", "--n_head=2", "--max_seq_len=32", "--device_batch_size=2",
              "--device_type=cpu"]
# ...and a run of it that takes seconds: one accumulation step, evaluation every 4 steps, 4-token samples, a fixed
# depth and no step-count curriculum (records of n_sup_train steps each, as the tests read them; sampled depth and the
# curriculum have tests of their own)
TINY = TINY_SHAPE + ["--n_loops=1", "--n_sup_train=2", "--eval_tokens=256", "--eval_every=4", "--sample_every=0",
                     "--sample_tokens=4", "--matrix_lr=0.02", "--warmup_steps=1", "--gradient_accumulation_steps=1",
                     "--sample_n_sup=false", "--n_sup_warmup=0"]


def parsed(argv, world_size=1):
    """base_train's parsed flags, less the command line they came from."""
    from nanochat.train.config import parse_args
    args = vars(parse_args(argv, world_size=world_size, check_hardware=False))
    args.pop("argv")
    return args


def ckpt_dir(base_dir, tag, step=None):
    path = os.path.join(base_dir, "base_checkpoints", tag)
    return path if step is None else os.path.join(path, f"step_{step:06d}")


def weights(base_dir, tag, step):
    from safetensors.torch import load_file
    return load_file(os.path.join(ckpt_dir(base_dir, tag, step), "model.safetensors"))


def tree(path):
    """Every file under path with its size and mtime: 'writes nothing' means this does not change."""
    return {os.path.join(d, f): (os.path.getsize(os.path.join(d, f)), os.path.getmtime(os.path.join(d, f)))
            for d, _, files in os.walk(path) for f in files}


# The launch scripts' environment overrides: a test clears them so the caller's environment cannot steer a script.
OVERRIDES = ["DEPTH", "NPROC", "DEVICE_TYPE", "NANOCHAT_DATA_DIR", "DATASET", "VOCAB_SIZE", "TOK_MAX_CHARS", "NNODES",
             "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "DRY_RUN", "FORCE", "HARDWARE"]

# ---------------------------------------------------------------------------------------------------- processes

HANG = 90  # seconds: far above what a healthy run takes here, so only a hang reaches it


def finish(proc, timeout=HANG):
    """(exit code, stdout + stderr) of a run, killed with everything it started if it hangs."""
    done = processes.finish(proc, timeout)
    return done.returncode, done.stdout + (done.stderr or "")


def read_until(proc, prefix, timeout=HANG):
    return processes.read_until(proc, prefix, timeout)


def stderr_capture(monkeypatch, terminal):
    """Replace sys.stderr with a buffer that claims to be a terminal (or not): progress bars decide by it."""
    class Stderr(io.StringIO):
        def isatty(self):
            return terminal
    monkeypatch.setattr(sys, "stderr", Stderr())
    return sys.stderr


def shard_texts(path):
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def launcher_in_process(monkeypatch, base_dir, gpu_name):
    """scripts.launch in this process on a stand-in node of 8 such GPUs, with the commands it would run recorded
    (returned) instead of run, and the caller's launch environment cleared."""
    from scripts import launch
    for name in OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    monkeypatch.setattr(launch, "detect_gpus", lambda: [(gpu_name, 80e9)] * 8)
    ran = []
    monkeypatch.setattr(launch, "run", ran.append)
    return ran


def exit_code(main, *argv):
    """An entry point's main in this process: its exit code (0 when it returns)."""
    try:
        main(list(argv))
    except SystemExit as e:
        return e.code
    return 0


def private_base_dir(base_dir, tmp_path, monkeypatch, copy_data=False):
    """A NANOCHAT_BASE_DIR of the test's own holding the shared tokenizer and corpus (the shards linked, or copied
    when the test replaces one), so a test may break things in it."""
    import shutil
    copy = tmp_path / "base"
    shutil.copytree(os.path.join(base_dir, "tokenizer"), copy / "tokenizer")
    if copy_data:
        shutil.copytree(os.path.join(base_dir, "base_data"), copy / "base_data")
    else:
        os.symlink(os.path.join(base_dir, "base_data"), copy / "base_data")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(copy))
    monkeypatch.delenv("NANOCHAT_DATA_DIR", raising=False)
    return str(copy)


def base_train_child_in_process(cmd, env=None):
    """lifecycle.run_child's (exit code, signal) for a `python -m scripts.base_train ...` child, run in this process
    instead (a process start costs seconds here): for tests whose point is not the child process itself."""
    from scripts import base_train
    assert cmd[1:3] == ["-m", "scripts.base_train"], cmd
    try:
        base_train.main(cmd[3:])
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), None
    return 0, None
