"""
Chat evaluation by supervision step: every question answered greedily by the model run with 1, 2, ..., N supervision
steps (the answer it would give if it stopped refining there), scored by exact match with its one right answer.

An item is a conversation whose last message is the assistant's reference answer: the model answers the rest (the
chat_sft rendering, nanochat/data/chat.py, then <|assistant_start|>) until <|assistant_end|> or max_tokens, and the
reply, stripped of surrounding whitespace, must equal the reference stripped. "ended" counts replies closed by
<|assistant_end|> within max_tokens: the format, right or wrong.

    result = evaluate_chat(model, tokenizer, items, n_steps=6)    # items: [(task, messages)]
    print(format_chat_eval(result))

evaluate_chat_server asks the same questions through lm-eval's chat backend (local-chat-completions) of a running
server's /v1/chat/completions, one pass per step (n_sup sent as a generation argument), and scores the replies the
same way: a model served answers as the one evaluated in-process (tests/test_chat_serve.py checks it).
"""

import contextlib
import json
import os
import tempfile

import torch

from nanochat.common import progress_bar
from nanochat.data.chat import ChatDataError, conversation_problem, read_conversations, render_prompt
from nanochat.data.chat_tasks import builtin_items
from nanochat.eval.loss_eval import step_name
from nanochat.model.engine import Engine

EXAMPLES = 3  # replies kept per task in the result, for the report


def items_from(spec, limit=None):
    """[(task, messages)] to evaluate: `builtin` (the built set's test split, its tasks by name) or a .jsonl / hf:
    spec of conversations ending with the assistant's reference (task: the spec). limit: items per task."""
    if spec == "builtin":
        items = builtin_items("test")
    else:
        items = [(spec, messages) for messages in read_conversations(spec)]
        for i, (_, messages) in enumerate(items):
            if messages[-1]["role"] != "assistant":
                raise ChatDataError(f"{spec}: conversation {i + 1} does not end with the assistant's answer, which "
                                    "is the reference it is scored against")
    if limit:
        kept, counts = [], {}
        for task, messages in items:
            counts[task] = counts.get(task, 0) + 1
            if counts[task] <= limit:
                kept.append((task, messages))
        items = kept
    return items


@torch.no_grad()
def evaluate_chat(model, tokenizer, items, n_steps, batch_size=32, max_tokens=16, autocast=None):
    """Exact match and ended rate per task at every supervision step 1..n_steps, as a JSON-ready dict: steps, tasks
    {task: {count, constant, accuracy[step], ended[step]}}, all {...}, examples {task: [{question, answer,
    replies[step]}]}. constant: the best exact match one reply given to every question gets (the commonest answer's
    share), the floor a model that learned only the format can reach."""
    check_items(items)
    prompts = [render_prompt(tokenizer, messages[:-1]) for _, messages in items]
    engine = Engine(model, tokenizer, autocast=autocast or contextlib.nullcontext)
    end = {tokenizer.encode_special("<|assistant_end|>")}
    replies = []  # [step][item] (text, ended)
    model.eval()
    with progress_bar(total=n_steps * len(prompts), desc="answering", unit="replies") as bar:
        for s in range(1, n_steps + 1):
            row = []
            for start in range(0, len(prompts), batch_size):
                outputs = engine.generate_batch(prompts[start:start + batch_size], max_tokens=max_tokens,
                                                temperature=0, n_sup=s, stop_tokens=end)
                row += [(tokenizer.decode(ids).strip(), len(ids) < max_tokens) for ids in outputs]
                bar.update(len(outputs))
            replies.append(row)
    return scored(items, replies, max_tokens)


def check_items(items):
    if not items:
        raise ChatDataError("no conversations to evaluate")
    for task, messages in items:
        problem = conversation_problem({"messages": messages})
        if problem or messages[-1]["role"] != "assistant":
            raise ChatDataError(f"{task}: {problem or 'the last message must be the reference answer'}")


def scored(items, replies, max_tokens):
    """The result dict of evaluate_chat from replies[step][item] = (text, ended or None when not known)."""
    answers = [messages[-1]["content"].strip() for _, messages in items]
    n_steps = len(replies)
    tasks = sorted({task for task, _ in items}, key=[task for task, _ in items].index)

    def scores(indices):
        references = [answers[i] for i in indices]
        return {"count": len(indices),
                "constant": max(map(references.count, set(references))) / len(indices),  # one reply to all
                "accuracy": [sum(replies[s][i][0] == answers[i] for i in indices) / len(indices)
                             for s in range(n_steps)],
                "ended": [None if any(replies[s][i][1] is None for i in indices) else
                          sum(replies[s][i][1] for i in indices) / len(indices) for s in range(n_steps)]}
    by_task = {task: [i for i, (t, _) in enumerate(items) if t == task] for task in tasks}
    return {"steps": list(range(1, n_steps + 1)), "max_tokens": max_tokens,
            "tasks": {task: scores(indices) for task, indices in by_task.items()},
            "all": scores(list(range(len(items)))),
            "examples": {task: [{"question": items[i][1][-2]["content"], "answer": answers[i],
                                 "replies": [replies[s][i][0] for s in range(n_steps)]} for i in indices[:EXAMPLES]]
                         for task, indices in by_task.items()}}


def format_chat_eval(result, trained_steps=None):
    """The result as a Markdown table: a row per supervision step, exact match per task, overall, and ended; the last
    row the floor a constant reply reaches."""
    tasks = list(result["tasks"])
    lines = ["| supervision step | " + " | ".join(f"{t} (n={result['tasks'][t]['count']})" for t in tasks) +
             " | all | ended with <\\|assistant_end\\|> |",
             "|---" * (len(tasks) + 3) + "|"]
    for s, step in enumerate(result["steps"]):
        mark = " (trained)" if trained_steps and step <= trained_steps else ""
        lines.append(f"| {step_name(s)}{mark} | " +
                     " | ".join(f"{result['tasks'][t]['accuracy'][s]:.3f}" for t in tasks) +
                     f" | {result['all']['accuracy'][s]:.3f} | {fraction(result['all']['ended'][s])} |")
    lines.append("| one reply to every question, at best | " +
                 " | ".join(f"{result['tasks'][t]['constant']:.3f}" for t in tasks) + " | | |")
    return "\n".join(lines)


def fraction(value):
    return "n/a" if value is None else f"{value:.3f}"


def format_examples(result):
    lines = []
    for task, examples in result["examples"].items():
        for e in examples:
            question = e["question"].replace("\n", " / ")
            replies = " | ".join(f"{step_name(s)}: {r!r}" for s, r in enumerate(e["replies"]))
            lines.append(f"- {task}: {question!r} -> expected {e['answer']!r}; {replies}")
    return "\n".join(lines)


def plot_chat_eval(result, title, trained_steps=None):
    """A matplotlib figure: exact match against supervision steps, a line per task and overall (dashed), each task's
    constant-reply floor dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use, which must precede it
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for task, scores in result["tasks"].items():
        line, = ax.plot(result["steps"], scores["accuracy"], marker="o", label=f"{task} (n={scores['count']})")
        ax.axhline(scores["constant"], color=line.get_color(), lw=0.8, ls=":")  # a constant reply's best
    ax.plot(result["steps"], result["all"]["accuracy"], "k--", marker="s", label="all")
    if trained_steps and trained_steps < result["steps"][-1]:
        ax.axvline(trained_steps + 0.5, color="grey", lw=0.8, ls=":")
        ax.text(trained_steps + 0.55, 0.02, "past the trained steps", fontsize=8, color="grey")
    ax.set(title=title, xlabel="supervision steps run at inference", ylabel="exact match", ylim=(-0.02, 1.02),
           xticks=result["steps"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# lm-eval's generate_until task over a JSON-lines file of {question, answer}: the replies are scored here, not by it
LM_EVAL_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  max_gen_toks: {max_tokens}
  temperature: 0
metric_list:
  - metric: exact_match
"""


def single_turn(task, messages):
    """A conversation as lm-eval's chat backend sends it, one user message: a system message folded in as the chat
    rendering folds it, so the server renders the same ids."""
    turns = [m for m in messages[:-1] if m["role"] != "system"]
    if len(turns) != 1:
        raise ChatDataError(f"{task}: lm-eval's chat backend sends one user message; this conversation has "
                            f"{len(turns)} turns before the answer")
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    return f"{system}\n\n{turns[0]['content']}" if system else turns[0]["content"]


def evaluate_chat_server(url, model_id, items, n_steps, max_tokens=16, api_key=None):
    """evaluate_chat's result, each question asked through lm-eval's local-chat-completions of the server at url
    (its /v1/chat/completions), greedily, once per supervision step (n_sup as a generation argument). Whether a
    reply ended with <|assistant_end|> is not told through lm-eval: ended is None."""
    import lm_eval  # lazy: the optional [eval] extra
    from lm_eval.tasks import TaskManager
    check_items(items)
    docs = [{"question": single_turn(task, messages), "answer": messages[-1]["content"]} for task, messages in items]
    model_args = {"base_url": f"{url.rstrip('/')}/v1/chat/completions", "model": model_id, "max_retries": 1}
    if api_key:
        model_args["header"] = {"Authorization": f"Bearer {api_key}"}
    replies = []
    with tempfile.TemporaryDirectory() as directory:
        data = os.path.join(directory, "chat_items.jsonl")
        with open(data, "w", encoding="utf-8") as f:
            f.write("".join(json.dumps(doc) + "\n" for doc in docs))
        with open(os.path.join(directory, "nanochat_chat.yaml"), "w", encoding="utf-8") as f:
            f.write(LM_EVAL_TASK.format(name="nanochat_chat", data=data, max_tokens=max_tokens))
        # only this task: indexing lm-eval's thousands of built-in task files takes ~15 s and none is used
        manager = TaskManager(include_path=directory, include_defaults=False)
        for s in range(1, n_steps + 1):
            results = lm_eval.simple_evaluate(model="local-chat-completions", tasks=["nanochat_chat"],
                                              task_manager=manager, model_args=model_args, apply_chat_template=True,
                                              gen_kwargs={"n_sup": s}, log_samples=True)
            samples = sorted(results["samples"]["nanochat_chat"], key=lambda sample: sample["doc_id"])
            replies.append([(sample["resps"][0][0].strip(), None) for sample in samples])
    return scored(items, replies, max_tokens)
