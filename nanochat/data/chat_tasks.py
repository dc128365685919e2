"""
The built conversation set (`--data=builtin`): small generative tasks with one exact answer, generated offline and
deterministic in (split, seed), for the CPU demonstration of chat_sft and for chat evaluation by supervision step.

    arithmetic   "What is three plus four?" -> "seven": sums of two numbers 0..9, in words. A closed set of 100 facts,
                 so the test split asks facts the training split holds too (in other words and order): a recall test.
    hops         a hops table (nanochat/data/synthetic.py: a cycle through 5 letters, "a>c c>e ..."), then "Where
                 does a go after 2 hops?" -> "e": 1 or 2 chained lookups in a table never seen before, an in-context
                 test that needs depth (the recursion's case).

Each conversation is one user question and one assistant answer, a tenth of them after a system message.
"""

import random
import string

from nanochat.data.synthetic import HopsSpec, draw_table

NUMBER_WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                "sixteen seventeen eighteen nineteen").split()
ARITHMETIC_QUESTIONS = ("What is {a} plus {b}?", "How much is {a} plus {b}?", "Add {a} and {b}.",
                        "What do you get when you add {a} and {b}?", "{A} plus {b} makes what?")
HOPS_SPEC = HopsSpec(n_symbols=5, max_hops=2, n_queries=1)
SYSTEM = "You answer with one word."
SPLIT_SEEDS = {"train": 0, "test": 1}  # different streams: the test split's hops tables are new
BUILTIN_SIZES = {"train": 4000, "test": 100}  # per split: train in all, test per task


def arithmetic(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    question = rng.choice(ARITHMETIC_QUESTIONS).format(a=NUMBER_WORDS[a], b=NUMBER_WORDS[b],
                                                        A=NUMBER_WORDS[a].capitalize())
    return question, NUMBER_WORDS[a + b]


def hops(rng):
    f, order, [(x, h, y)] = draw_table(rng, list(string.ascii_lowercase[:HOPS_SPEC.n_symbols]), HOPS_SPEC)
    table = " ".join(f"{k}>{f[k]}" for k in order)
    return f"{table}\nWhere does {x} go after {h} hop{'s' if h > 1 else ''}?", y


TASKS = {"arithmetic": arithmetic, "hops": hops}


def conversation(question, answer, system=False):
    return ([{"role": "system", "content": SYSTEM}] if system else []) + [
        {"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def builtin_items(split="test", count=None, seed=0):
    """[(task, conversation)] of a split: tasks in turn, `count` of each (default BUILTIN_SIZES[split] in all for
    train, per task for test)."""
    rng = random.Random(f"chat_tasks:{split}:{SPLIT_SEEDS[split]}:{seed}")
    per_task = count if count is not None else \
        BUILTIN_SIZES[split] // len(TASKS) if split == "train" else BUILTIN_SIZES[split]
    items = []
    for _ in range(per_task):
        for name, task in TASKS.items():
            question, answer = task(rng)
            items.append((name, conversation(question, answer, system=rng.random() < 0.1)))
    return items


def builtin_conversations(split="train", seed=0):
    return [messages for _, messages in builtin_items(split, seed=seed)]
