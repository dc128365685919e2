"""
What the viewer's per-step data costs: time to first token and per-token decode time of
nanochat.serve.refinement.generate (each step's head, probabilities and halting score per token, each event
JSON-encoded as the server sends it) against a plain Engine.generate, same model, prompt and tokens.

python -m dev.bench_refinement --n_sup 4 --vocab 4096 --threads 1      # dev/runcpu.sh's model shape, random weights

Greedy, no stop token, so both produce the same max_tokens tokens (checked). Weights are random (every one of them,
so the argmax is not constant); token names come from a stand-in tokenizer (the token's number), as no trained
tokenizer is needed to time the model. Rounds alternate plain and per-step; medians are printed, in wall time and in
this thread's CPU time (with --threads 1 the steadier of the two on a shared machine).
"""

import argparse
import json
import statistics
import time

import torch

from dev.bench_args import add_model_flags, build_config
from dev.bench_engine import random_model
from nanochat.model.engine import Engine
from nanochat.model.halting import Halting
from nanochat.serve import refinement


class NumberNames:
    """The tokenizer surface refinement.generate reads, naming each token by its id."""

    class enc:
        @staticmethod
        def decode_single_token_bytes(token):
            return str(token).encode()

    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))

    @staticmethod
    def encode_special(name):
        raise KeyError(name)  # no stop tokens: every run makes max_tokens tokens


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="per-step data overhead of the refinement viewer")
    add_model_flags(parser)
    parser.add_argument("--n_loops", type=int, default=1)
    parser.add_argument("--n_sup", type=int, default=4)
    parser.add_argument("--prompt_tokens", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--halt", default="kl:0.0005", help="the rule whose halting step is marked per token")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--device_type", default="cpu")
    return parser.parse_args(argv)


def timed(tokens_of):
    """(tokens, [seconds to the first token, seconds per later token] in wall time, then the same in this thread's CPU
    time: with one torch thread all the work is this thread's, and CPU time barely moves when others load the
    machine)."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    tokens, first = [], None
    for token in tokens_of():
        tokens.append(token)
        first = first or (time.perf_counter() - wall0, time.thread_time() - cpu0)
    total = (time.perf_counter() - wall0, time.thread_time() - cpu0)
    later = max(1, len(tokens) - 1)
    return tokens, [first[0], (total[0] - first[0]) / later, first[1], (total[1] - first[1]) / later]


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device_type)
    config = build_config(args, sequence_len=max(256, args.prompt_tokens), n_loops=args.n_loops, T_recursion=1,
                          n_sup_train=args.n_sup)
    model = random_model(config, device)  # every weight random: each step's logits differ
    engine = Engine(model, NumberNames())
    prompt = torch.randint(0, config.vocab_size, (args.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    request = refinement.Request("generate", prompt, args.n_sup, max_tokens=args.max_tokens, temperature=0.0,
                                 halting=Halting.parse(args.halt))

    def plain():
        for column in engine.generate([prompt], max_tokens=args.max_tokens, temperature=0.0, n_sup=args.n_sup,
                                      stop_tokens=()):
            yield column[0]

    def per_step():
        for event in refinement.generate(engine, request):
            json.dumps(event)  # the server sends each event as JSON
            if event["object"] == "refinement.token":
                yield event["id"]

    results = {"plain": [], "per-step": []}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, run in (("plain", plain), ("per-step", per_step)):
            tokens, times = timed(run)
            if round_:
                results[name].append(times)
            if name == "plain":
                want = tokens
            elif tokens != want:
                raise SystemExit("error: the per-step generation made other tokens than the plain one")
    print(f"model: depth {args.depth}, n_embd {args.n_embd}, vocab {args.vocab}, n_loops {args.n_loops}, "
          f"n_sup {args.n_sup}; prompt {args.prompt_tokens} tokens, {args.max_tokens} generated; halt {args.halt}; "
          f"{args.device_type}, {torch.get_num_threads()} threads; medians of {args.rounds} rounds")
    medians = {name: [statistics.median(v) for v in zip(*runs)] for name, runs in results.items()}
    plain_times, step_times = medians["plain"], medians["per-step"]
    for clock, at in (("wall", 0), ("cpu", 2)):
        for name, times in medians.items():
            print(f"{clock:4s} {name:9s} time to first token {1e3 * times[at]:8.2f} ms   "
                  f"per token {1e3 * times[at + 1]:8.3f} ms")
        print(f"{clock:4s} overhead  time to first token {100 * (step_times[at] / plain_times[at] - 1):+.1f}%   "
              f"per token {100 * (step_times[at + 1] / plain_times[at + 1] - 1):+.1f}%")


if __name__ == "__main__":
    main()
