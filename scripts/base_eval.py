"""
Downstream tasks for a checkpoint at every supervision step, through EleutherAI's lm-evaluation-harness (lm-eval).

    python -m scripts.base_eval --model_tag=d12 --step=best                 # the default tasks, steps
    1..n_sup_inference python -m scripts.base_eval --model_tag=d4 --n_sup=6 --limit=200        # past the trained steps,
    200 examples a task python -m scripts.base_eval --tasks=my_task --include_path=dir/         # task YAML files of
    your own

The checkpoint is wrapped in-process as an lm-eval model (NanochatLM): one forward through the recursion scores every
request at every supervision step, and lm-eval computes its metrics once per step from those scores. Every text
starts with <|bos|>, as the model saw every document in training. Tasks scored by log-likelihood (multiple choice,
lambada, perplexity) are supported; generation tasks are refused. Results go to
<run dir>/base_eval_step<N>.json, to the run's report.md and to plot_run's figure.
"""

import nanochat.cuda_allocator  # noqa: F401 - first, before torch: see the module

# isort: split
import contextlib
import json
import os
import sys

import torch

from nanochat.cli import DefaultsHelp, Exit, OneLineErrors, missing_package

try:
    import lm_eval
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:
    sys.exit(f"error: {missing_package(e, 'base_eval')}")

from nanochat import checkpoint as ckpt
from nanochat.common import autocast_for, autodetect_device_type, default_dtype, progress_bar
from nanochat.eval.metrics import refresh_downstream_section
from nanochat.files import atomic_write_bytes, exit_on_write_error

# nanochat's CORE in spirit: small, well-known, scored by log-likelihood
DEFAULT_TASKS = "hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai"


class NanochatLM(TemplateLM):
    """A GPT as an lm-eval model. Each (context, continuation) is scored at every supervision step 1..n_sup in one
    forward and kept; `step` selects the step whose scores lm-eval sees, so evaluating step after step costs one
    forward per request."""

    def __init__(self, model, tokenizer, n_sup, batch_size=8, autocast=None):
        super().__init__()
        self.model, self.tokenizer, self.n_sup = model, tokenizer, n_sup
        self.batch_size = batch_size
        self.autocast = autocast or contextlib.nullcontext  # a function returning a fresh context per forward
        self._device = next(model.parameters()).device  # lm-eval reads it as .device
        self.step = n_sup
        self.scores = {}  # (context ids, continuation ids) -> [(log-likelihood, greedy)] per supervision step

    @property
    def eot_token_id(self):
        return self.tokenizer.get_bos_token_id()  # an empty context is <|bos|> alone

    @property
    def max_length(self):
        return self.model.config.sequence_len

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """<|bos|> first unless lm-eval asks for the bare text (a continuation, or a rolling window's tokens)."""
        return self.tokenizer.encode(string, prepend=None if add_special_tokens is False else "<|bos|>")

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        keys = [(tuple(context), tuple(continuation)) for _, context, continuation in requests]
        missing = sorted({key for key in keys if key not in self.scores}, key=lambda k: -len(k[0]) - len(k[1]))
        for i in progress_bar(range(0, len(missing), self.batch_size), desc="scoring", unit="batches"):
            batch = missing[i:i + self.batch_size]
            self.scores.update(zip(batch, self.score_batch(batch)))
        return [self.scores[key][self.step - 1] for key in keys]

    @torch.no_grad()
    def score_batch(self, batch):
        """[(log-likelihood, greedy) per supervision step] of each (context, continuation), left-truncated to the
        model's context; right padding, so no position attends to it."""
        rows = [(context + continuation)[-(self.max_length + 1):] for context, continuation in batch]
        idx = torch.zeros(len(rows), max(map(len, rows)) - 1, dtype=torch.long)
        for i, row in enumerate(rows):
            idx[i, :len(row) - 1] = torch.tensor(row[:-1])
        idx = idx.to(self.device)
        scores = [[] for _ in batch]
        with self.autocast():
            for y, _ in self.model.refine(idx, self.n_sup):
                for i, (row, (_, continuation)) in enumerate(zip(rows, batch)):
                    end = len(row) - 1
                    logprobs = torch.log_softmax(self.model.head(y[i, end - len(continuation):end]).float(), dim=-1)
                    target = torch.tensor(continuation, device=logprobs.device)
                    loglikelihood = logprobs.gather(-1, target[:, None]).sum().item()
                    scores[i].append((loglikelihood, bool((logprobs.argmax(-1) == target).all())))
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """Whole-text log-likelihood in windows of the model's context, each token scored once (lm-eval's rule)."""
        totals = []
        for (text,) in (request.args for request in requests):
            windows = get_rolling_token_windows(self.tok_encode(text, add_special_tokens=False),
                                                self.prefix_token_id, self.max_length, 1)
            pairs = [(None, *make_disjoint_window(window)) for window in windows]
            totals.append(sum(loglikelihood for loglikelihood, _ in self._loglikelihood_tokens(pairs)))
        return totals

    def generate_until(self, requests, disable_tqdm=False):
        raise NotImplementedError("base_eval scores tasks by log-likelihood; for generation tasks export the model "
                                  "(python -m scripts.export_hf) and run lm_eval --model hf on it")


def parse_args(argv=None):
    p = OneLineErrors(prog="python -m scripts.base_eval", allow_abbrev=False,
                      formatter_class=DefaultsHelp)
    ckpt.checkpoint_flags(p)
    p.add_argument("--n_sup", type=int, default=None,
                   help="evaluate steps 1..n_sup (default: n_sup_inference); more than were trained is allowed")
    p.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated lm-eval task or group names")
    p.add_argument("--include_path", default=None, help="a directory of task YAML files of your own (default: none)")
    p.add_argument("--limit", type=float, default=None,
                   help="examples per task (below 1: a fraction); quick runs (default: all)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    p.add_argument("--batch_size", type=int, default=8, help="sequences per forward")
    p.add_argument("--bootstrap_iters", type=int, default=1000, help="for the stderr of non-mean metrics")
    p.add_argument("--device_type", default="", help="cuda | cpu | mps (default: autodetect: cuda, mps, cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="autocast dtype (default: bfloat16 on CUDA, float32 elsewhere)")
    args = p.parse_args(argv)
    for name in ("n_sup", "batch_size", "limit"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name}={getattr(args, name)} must be > 0")
    if args.include_path and not os.path.isdir(args.include_path):
        p.error(f"--include_path {args.include_path} is not a directory")
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return args


def task_manager(tasks, include_path):
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise Exit(f"base_eval: unknown task(s) {', '.join(unknown)}; list them with `lm_eval ls tasks`, or give "
                   "the directory of your task files with --include_path")
    return manager


def metrics_by_step(per_step):
    """{task: {metric: [value at step 1, 2, ...]}} from lm-eval's results per step ('acc,none' -> 'acc')."""
    tasks = {}
    for results in per_step:
        for task, values in results["results"].items():
            for key, value in values.items():
                if "," in key and isinstance(value, (int, float)):  # metric,filter; not alias or sample_len
                    tasks.setdefault(task, {}).setdefault(key.removesuffix(",none"), []).append(value)
    return tasks


def evaluate_steps(lm, tasks, manager, log_samples=False, **kwargs):
    """lm-eval's output for each supervision step 1..lm.n_sup."""
    per_step = []
    for step in range(1, lm.n_sup + 1):
        lm.step = step
        per_step.append(lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                                log_samples=log_samples, **kwargs))
    return per_step


def main(argv=None):
    args = parse_args(argv)
    manager = task_manager(args.tasks, args.include_path)
    device_type = args.device_type or autodetect_device_type()
    device = torch.device(device_type)
    try:
        model, tokenizer, meta, model_tag, _ = ckpt.open_checkpoint(args.model_tag, args.step, device)
    except ValueError as e:
        raise Exit(f"base_eval: {e}")
    model.eval()
    n_sup = args.n_sup or model.config.n_sup_inference
    if n_sup > model.config.n_sup_train:
        print(f"note: {n_sup} supervision steps, past the {model.config.n_sup_train} the model was trained with")
    dtype = args.dtype or default_dtype(device_type)
    lm = NanochatLM(model, tokenizer, n_sup, args.batch_size, lambda: autocast_for(device_type, dtype))
    limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
    try:
        per_step = evaluate_steps(lm, args.tasks, manager, limit=limit, num_fewshot=args.num_fewshot,
                                  bootstrap_iters=args.bootstrap_iters)
    except NotImplementedError as e:
        raise Exit(f"base_eval: {e}")
    results = {"model_tag": model_tag, "step": meta["step"], "n_sup": n_sup, "n_sup_train": model.config.n_sup_train,
               "limit": limit, "num_fewshot": args.num_fewshot, "lm_eval_version": lm_eval.__version__,
               "tasks": metrics_by_step(per_step)}
    for task, metrics in results["tasks"].items():
        for metric, values in metrics.items():
            if "stderr" not in metric:
                print(f"{task:24s} {metric:16s} per step: {' '.join(f'{v:.4f}' for v in values)}")
    run_dir = ckpt.model_dir(model_tag)
    path = os.path.join(run_dir, f"base_eval_step{meta['step']:06d}.json")
    with exit_on_write_error("base_eval"):
        atomic_write_bytes(path, json.dumps(results, indent=2).encode(),
                           ", then run base_eval again to save the results printed above")
        print(f"results: {path}")
        print(f"report: {refresh_downstream_section(run_dir)}")
    return results


if __name__ == "__main__":
    main()
