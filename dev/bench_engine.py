"""
Decode speed with and without the KV cache, at several sequence lengths, and the cache's memory per token.

python -m dev.bench_engine --depth 4 --n_embd 256 --n_loops 2 --n_sup 4 --lengths 64,128,256,512

For each length L: a prompt of L - decode_tokens tokens, then decode_tokens greedy tokens, either with the engine
(prefill once, then one token per forward) or uncached (a full forward over the whole sequence per token). Both
must produce the same tokens. Weights are random (all of them, so the argmax is not constant).
"""

import argparse
import math
import time

import torch

from dev.bench_args import add_model_flags, build_config
from nanochat.model.engine import Engine, kv_cache_bytes_per_token
from nanochat.model.gpt import GPT


def parse_args():
    parser = argparse.ArgumentParser(description="KV cache decode benchmark")
    add_model_flags(parser, n_head=4)
    parser.add_argument("--n_kv_head", type=int, default=4)
    parser.add_argument("--n_loops", type=int, default=2)
    parser.add_argument("--T_recursion", type=int, default=1)
    parser.add_argument("--n_sup", type=int, default=4)
    parser.add_argument("--lengths", default="64,128,256,512", help="comma-separated total sequence lengths")
    parser.add_argument("--decode_tokens", type=int, default=8, help="tokens decoded (and timed) per length")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device_type", default="cpu")
    return parser.parse_args()


def random_model(config, device):
    torch.manual_seed(0)
    model = GPT(config).to(device)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=1.0 / math.sqrt(p.size(-1)))
    return model.eval()


@torch.inference_mode()
def uncached_greedy(model, prompt, n_tokens, n_sup):
    idx = torch.tensor([prompt], device=model.lm_head.weight.device)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        next_id = model(idx, n_sup=n_sup)[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, next_id], dim=1)
    return idx[0, len(prompt):].tolist(), time.perf_counter() - t0


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    config = build_config(args, sequence_len=max(lengths), n_kv_head=args.n_kv_head, n_loops=args.n_loops,
                          T_recursion=args.T_recursion, n_sup_train=args.n_sup)
    model = random_model(config, torch.device(args.device_type))
    engine = Engine(model)
    per_token = kv_cache_bytes_per_token(model, args.n_sup)
    slots = model.num_attention_slots(args.n_sup)
    print(f"config: depth={args.depth} n_embd={args.n_embd} n_head={args.n_head} n_kv_head={args.n_kv_head} "
          f"n_loops={args.n_loops} T_recursion={args.T_recursion} n_sup={args.n_sup} vocab={args.vocab} | "
          f"{model.num_params() / 1e6:.2f}M params | torch threads={torch.get_num_threads()} | {args.device_type}")
    print(f"KV cache: {slots} attention slots, {per_token:,} bytes/token (fp32) = "
          f"{per_token * max(lengths) / 2 ** 20:.1f} MiB at {max(lengths)} tokens; "
          f"a cache per physical layer would hold {per_token // slots * args.depth:,} bytes/token and be wrong")
    print(f"decoding {args.decode_tokens} greedy tokens after a prompt of L - {args.decode_tokens} tokens, batch 1")
    print(f"{'L':>6} {'cached tok/s':>13} {'uncached tok/s':>15} {'speedup':>8} {'prefill tok/s':>14}  same tokens")
    g = torch.Generator().manual_seed(0)
    for L in lengths:
        prompt = torch.randint(0, args.vocab, (L - args.decode_tokens,), generator=g).tolist()
        cached = engine.generate_batch([prompt], max_tokens=args.decode_tokens, temperature=0.0, n_sup=args.n_sup,
                                       stop_tokens=())[0]
        s = engine.stats
        cached_rate = s["decode_tokens"] / s["decode_s"]  # the first token comes from the prefill
        uncached, seconds = uncached_greedy(model, prompt, args.decode_tokens, args.n_sup)
        uncached_rate = args.decode_tokens / seconds
        print(f"{L:>6} {cached_rate:>13.1f} {uncached_rate:>15.2f} {cached_rate / uncached_rate:>7.1f}x "
              f"{s['prefill_tokens'] / s['prefill_s']:>14.1f}  {cached == uncached}")


if __name__ == "__main__":
    main()
