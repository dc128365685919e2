"""
The TRM GPT as a Hugging Face transformers model: what `scripts/export_hf.py` writes and `trust_remote_code` runs.

The export copies this file, nanochat/model/gpt.py and nanochat/model/engine.py side by side (transformers copies every
file a remote-code module imports relatively), so the recursion exists once, in gpt.py, and cached attention once, in
engine.py. Every GPTConfig field is a key of config.json and the weights are GPT's own state dict under "model.", so
new fields and parameters of gpt.py need no change here.

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
    model(input_ids, n_sup=2).logits      # the last of 2 supervision steps (default: n_sup_inference)

generate keeps keys and values in a transformers Cache with one layer per attention slot of the recursion
(n_sup * T_recursion * n_layer * (n_loops+1)): each visit of a block sees its own inputs, so it has its own keys.
"""

from dataclasses import fields

import torch
import torch.nn.functional as F
import transformers
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .engine import KVCache
from .gpt import GPT, GPTConfig

if int(transformers.__version__.split(".")[0]) < 5:  # 4.x leaves the rotary tables on the meta device
    raise ImportError(f"this model needs transformers>=5 (found {transformers.__version__})")

# generate hands the model its cache as `cache` from transformers 5.24 and as `past_key_values` before; the model
# output names it the same way. Take either, answer in the installed version's own name.
CACHE_KEYWORDS = ("cache", "past_key_values")
CACHE_FIELD = next(name for name in CACHE_KEYWORDS if name in CausalLMOutputWithPast.__dataclass_fields__)


def pop_cache(kwargs):
    """The cache generate passed under any of CACHE_KEYWORDS (None if none), removed from kwargs."""
    caches = [kwargs.pop(name) for name in CACHE_KEYWORDS if name in kwargs]
    return next((cache for cache in caches if cache is not None), None)


class NanochatTRMConfig(PretrainedConfig):
    """GPTConfig's fields as keyword arguments (config.json keys); the standard names map onto them."""

    model_type = "nanochat_trm"
    attribute_map = {"hidden_size": "n_embd", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}

    def gpt_config(self):
        return GPTConfig(**{f.name: getattr(self, f.name) for f in fields(GPTConfig) if hasattr(self, f.name)})


class SlotCache(KVCache):
    """The engine's cached attention, with each slot's keys and values kept in one layer of a transformers Cache."""

    def __init__(self, cache, num_slots):
        super().__init__(num_slots, batch_size=None, max_len=None)
        # generate builds its cache with one layer per physical block; the recursion visits each several times
        cache.layers.extend(DynamicLayer() for _ in range(num_slots - len(cache.layers)))
        self.cache, self.pos = cache, cache.get_seq_length()

    def store(self, slot, k, v):
        return self.cache.update(k, v, slot)


class NanochatTRMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanochatTRMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.model = GPT(config.gpt_config())
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        if module is self.model:
            module.init_weights()  # also computes the rotary tables, which are not saved

    def forward(self, input_ids, labels=None, n_sup=None, attention_mask=None, use_cache=None, **kwargs):
        """Logits of the last of n_sup supervision steps; with labels, their next-token cross-entropy. With a
        Cache as `cache` or `past_key_values` (or use_cache=True, which starts one), input_ids continue the tokens
        it holds."""
        cache = pop_cache(kwargs)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("padding is not supported: pass prompts of equal length (e.g. one at a time), "
                             "without masked positions")
        if use_cache and cache is None:
            cache = DynamicCache()
        n_sup = n_sup or self.model.config.n_sup_inference
        slots = None if cache is None else SlotCache(cache, self.model.num_attention_slots(n_sup))
        logits = self.model(input_ids, n_sup=n_sup, kv_cache=slots)
        loss = None
        if labels is not None:  # labels are input_ids, shifted here (the transformers convention)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})

    def prepare_inputs_for_generation(self, input_ids, n_sup=None, **kwargs):
        cache = pop_cache(kwargs)
        if cache is not None:  # only the tokens the cache does not hold yet
            input_ids = input_ids[:, cache.get_seq_length():]
        return {"input_ids": input_ids, CACHE_FIELD: cache, "n_sup": n_sup}
