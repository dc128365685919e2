"""
Chat evaluation by supervision step: every question answered greedily by the model run with 1, 2, ..., N supervision
steps (the answer it would give if it stopped refining there), scored by exact match with its one right answer.

An item is a conversation whose last message is the assistant's reference answer: the model answers the rest (the
chat_sft rendering, nanochat/data/chat.py, then <|assistant_start|>) until <|assistant_end|> or max_tokens, and the
reply, stripped of surrounding whitespace, must equal the reference stripped. "ended" counts replies closed by
<|assistant_end|> within max_tokens: the format, right or wrong.

    result = evaluate_chat(model, tokenizer, items, n_steps=6)    # items: [(task, messages)]
    print(format_chat_eval(result))
"""

import contextlib

import torch

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
    if not items:
        raise ChatDataError("no conversations to evaluate")
    for task, messages in items:
        problem = conversation_problem({"messages": messages})
        if problem or messages[-1]["role"] != "assistant":
            raise ChatDataError(f"{task}: {problem or 'the last message must be the reference answer'}")
    prompts = [render_prompt(tokenizer, messages[:-1]) for _, messages in items]
    answers = [messages[-1]["content"].strip() for _, messages in items]
    engine = Engine(model, tokenizer, autocast=autocast or contextlib.nullcontext)
    end = {tokenizer.encode_special("<|assistant_end|>")}
    replies = []  # [step][item] (text, ended)
    model.eval()
    for s in range(1, n_steps + 1):
        row = []
        for start in range(0, len(prompts), batch_size):
            outputs = engine.generate_batch(prompts[start:start + batch_size], max_tokens=max_tokens, temperature=0,
                                            n_sup=s, stop_tokens=end)
            row += [(tokenizer.decode(ids).strip(), len(ids) < max_tokens) for ids in outputs]
        replies.append(row)
    tasks = sorted({task for task, _ in items}, key=[task for task, _ in items].index)

    def scores(indices):
        references = [answers[i] for i in indices]
        return {"count": len(indices),
                "constant": max(map(references.count, set(references))) / len(indices),  # one reply to all
                "accuracy": [sum(replies[s][i][0] == answers[i] for i in indices) / len(indices)
                             for s in range(n_steps)],
                "ended": [sum(replies[s][i][1] for i in indices) / len(indices) for s in range(n_steps)]}
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
                     f" | {result['all']['accuracy'][s]:.3f} | {result['all']['ended'][s]:.3f} |")
    lines.append("| one reply to every question, at best | " +
                 " | ".join(f"{result['tasks'][t]['constant']:.3f}" for t in tasks) + " | | |")
    return "\n".join(lines)


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
