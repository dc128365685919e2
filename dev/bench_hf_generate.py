"""
Decode speed of the exported Hugging Face model's generate, with transformers' cache and without.

python -m dev.bench_hf_generate --depth 4 --n_embd 256 --n_loops 2 --n_sup 4 --lengths 64,256 --threads 1

A random-weight model (every weight drawn, so greedy tokens vary) and a small BPE tokenizer are exported with
scripts/export_hf into a temporary directory and loaded back with AutoModelForCausalLM. For each total length L:
a prompt of L - new_tokens tokens, then greedy generate of new_tokens tokens with use_cache=True and with
use_cache=False. Decode tokens/s = (new_tokens - 1) / (time of generate(new_tokens) - time of generate(1)): the
prefill, which yields the first token, is taken out. Both must give the same tokens.
"""

import argparse
import math
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from dev.bench_args import add_model_flags, build_config
from nanochat.data.tokenizer import RustBPETokenizer
from nanochat.model.gpt import GPT
from scripts import export_hf


def parse_args():
    parser = argparse.ArgumentParser(description="exported model: generate's decode speed with and without the cache")
    add_model_flags(parser, n_head=4, vocab=1024,
                    vocab_help="at most: the tokenizer trained for the export stops when its text has no pairs left")
    parser.add_argument("--n_loops", type=int, default=2)
    parser.add_argument("--n_sup", type=int, default=4)
    parser.add_argument("--lengths", default="64,256", help="comma-separated total sequence lengths")
    parser.add_argument("--new_tokens", type=int, default=16, help="tokens generated per length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return parser.parse_args()


def export_random_model(args, directory):
    text = " ".join(f"word{i % 97} token{i % 13} the cat sat on the mat" for i in range(4000))
    tokenizer = RustBPETokenizer.train_from_iterator(iter([text]), args.vocab)
    config = build_config(args, sequence_len=max(args.lengths), vocab_size=tokenizer.get_vocab_size(),
                          n_loops=args.n_loops, n_sup_train=args.n_sup)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=1.0 / math.sqrt(p.size(-1)))
    export_hf.write_export(model, tokenizer, {"step": 0, "model_config": config.to_dict(), "val_bpb": None},
                           "random", directory)
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


@torch.inference_mode()
def timed_generate(hf, prompt, new_tokens, use_cache):
    t0 = time.perf_counter()
    out = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, use_cache=use_cache)
    return out[0, prompt.size(1):].tolist(), time.perf_counter() - t0


def decode_rate(hf, prompt, new_tokens, use_cache):
    """(generated tokens, decode tokens/s with the prefill's time taken out)."""
    _, prefill_s = timed_generate(hf, prompt, 1, use_cache)
    tokens, total_s = timed_generate(hf, prompt, new_tokens, use_cache)
    return tokens, (new_tokens - 1) / max(total_s - prefill_s, 1e-9)


def main():
    args = parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        hf = export_random_model(args, f"{tmp}/export")
    model = hf.model
    print(f"config: depth={args.depth} n_embd={args.n_embd} n_loops={args.n_loops} n_sup={args.n_sup} "
          f"vocab={model.config.vocab_size} | {model.num_params() / 1e6:.2f}M params | "
          f"{model.num_attention_slots(args.n_sup)} cache layers | torch threads={torch.get_num_threads()} | cpu")
    print(f"generate: {args.new_tokens} greedy tokens after a prompt of L - {args.new_tokens} tokens, batch 1")
    print(f"{'L':>6} {'cached tok/s':>13} {'uncached tok/s':>15} {'speedup':>8}  same tokens")
    g = torch.Generator().manual_seed(0)
    for L in args.lengths:
        prompt = torch.randint(0, model.config.vocab_size, (1, L - args.new_tokens), generator=g)
        cached, cached_rate = decode_rate(hf, prompt, args.new_tokens, use_cache=True)
        uncached, uncached_rate = decode_rate(hf, prompt, args.new_tokens, use_cache=False)
        print(f"{L:>6} {cached_rate:>13.1f} {uncached_rate:>15.2f} {cached_rate / uncached_rate:>7.1f}x  "
              f"{cached == uncached}")


if __name__ == "__main__":
    main()
