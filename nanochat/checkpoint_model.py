"""
The model a checkpoint's model_config describes: built on a device with its weights still to be loaded
(build_model), and whether a state dict fits it (weights_problem), checked on shapes before anything is allocated.
"""

import torch

from nanochat.gpt import GPT, GPTConfig


def build_model(config_dict, device):
    """GPT(GPTConfig.from_dict(config_dict)) on device, its weights uninitialised (a checkpoint overwrites them)."""
    config = GPTConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # fills the rotary buffers; the weights are overwritten by the checkpoint
    return model


def weights_problem(model, weights):
    """Why a state dict does not load into model (names and shapes, compared without touching values), or None."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    given = {k: tuple(v.shape) for k, v in weights.items()}
    missing, extra = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    wrong = [f"{k} is {list(given[k])}, the config needs {list(shape)}" for k, shape in expected.items()
             if k in given and given[k] != shape]
    parts = ([f"{len(missing)} weight(s) missing ({missing[0]}...)"] if missing else []) + \
        ([f"{len(extra)} unexpected ({extra[0]}...)"] if extra else []) + \
        ([f"{len(wrong)} of another shape ({wrong[0]})"] if wrong else [])
    return "; ".join(parts) or None
