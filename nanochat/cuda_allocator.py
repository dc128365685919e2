"""
Imported first, before torch, by every entry point that can run on a GPU: CUDA's caching allocator reads its setting
once, when CUDA first initialises, and base_train's flag parsing already initialises it (it plans memory from the
GPU's properties), so an allocator setting made any later is silently ignored. No torch import here.
"""

import os


def configure():
    """Expandable segments, as nanochat: each micro-step frees and reallocates blocks of every size (logits,
    activations), which fragment fixed segments. A user's setting (either variable name) wins."""
    if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


configure()
