"""The model: the GPT with its recursion (gpt), its training loss and head (supervision), halting, generation with a
KV cache (engine) and the transformers wrapper (hf_model). It imports nothing of the project outside itself, so the
HF export can copy these files as they are."""
