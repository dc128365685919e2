"""
Conversations for supervised fine-tuning (scripts/chat_sft.py): read and checked, rendered with the tokenizer's chat
tokens, and packed into training rows whose loss falls on the assistant's tokens only.

A conversation is OpenAI's chat format, one per line of a .jsonl file or one per row of a Hugging Face dataset
(`hf:NAME[:config][:split]`, SmolTalk's `messages` column):

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

An optional system message first, then user and assistant in turn, starting with the user; every content a string;
at least one assistant message. Rendered (RENDERING, the same text the HF export's chat template writes):

    <|bos|><|user_start|>question<|user_end|><|assistant_start|>answer<|assistant_end|><|user_start|>...

The tokenizer has no system token, so a system message's content opens the first user message, a blank line after
it (nanochat's rendering). The loss falls on each assistant message's tokens and on its <|assistant_end|>, so the
model learns to answer and to stop; nothing else is scored.

Packing (ChatLoader): each row of T+1 tokens holds whole conversations in order while they fit, the rest unscored; a
conversation longer than a row is cut to the row (its tail dropped). The order is a seeded shuffle per epoch, dealt
out to the data ranks; the position (epoch, index) is the loader's whole state, so a resumed loader yields exactly
the batches that would have come next.
"""

import hashlib
import json
import math
import os
import random

import torch

from nanochat.common import print0
from nanochat.data.chat_tasks import builtin_conversations
from nanochat.data.dataloader import UNSCORED
from nanochat.data.dataset import DatasetError, saved_by_datasets

ROLES = ("system", "user", "assistant")
RENDERING = ("<|bos|>, then per message: <|user_start|>text<|user_end|> or <|assistant_start|>text<|assistant_end|>; "
             "a system message opens the first user message, a blank line after it")
BUILTIN = "builtin"  # --data=builtin: the built conversation set
# Message text in the HF export's chat template: transformers tokenizes the template's whole output at once, so a
# message holding "<|user_end|>" would be that special token there, and ours encodes it as text. The template breaks
# every "<|" in a message with TEXT_ESCAPE ("<" ESC "|", and ESC itself doubled), and the exported tokenizer's
# normalizer (scripts/export_hf.py) undoes it after special tokens are matched: the same ids, by every tokenizing
# path (docs/chat.md). ESC is a Unicode noncharacter, reserved for a program's internal use.
TEXT_ESCAPE = "\ufdd0"
_ESC = f"\\u{ord(TEXT_ESCAPE):04x}"  # as a Jinja string literal spells it: the template's text stays ASCII
MESSAGE_TEXT = f"(message['content'] | replace('{_ESC}', '{_ESC}{_ESC}') | replace('<|', '<{_ESC}|'))"
# RENDERING as a Jinja chat template: what the HF export's tokenizer carries, so transformers' apply_chat_template
# writes the ids chat_sft trained on (tests/test_chat_template.py checks it against render_conversation, for any
# message text), and its {% generation %} marks give return_assistant_tokens_mask the loss mask
CHAT_TEMPLATE = (
    "{{- '<|bos|>' -}}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = " + MESSAGE_TEXT + " -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|user_start|>' -}}"
    "{%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
    "{{- " + MESSAGE_TEXT + " + '<|user_end|>' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|assistant_start|>' -}}{%- generation -%}{{- " + MESSAGE_TEXT + " + '<|assistant_end|>' -}}"
    "{%- endgeneration -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant_start|>' -}}{%- endif -%}"
)
VAL_EVERY = 20  # without --val_data, one conversation in 20 (5%, drawn with the seed) is held out for validation
ENCODE_CHUNK = 4096  # message texts encoded together (tiktoken's threaded batch)


class ChatDataError(DatasetError):
    """Conversations that cannot be read or used: the message names the file and line (or row) and what is wrong."""


# ---------------------------------------------------------------------------------------------------- checking
def conversation_problem(record):
    """Why a record is not a usable conversation, in words, or None."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__} where an object with \"messages\" belongs"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no \"messages\" list" if messages is None else "\"messages\" is not a non-empty list"
    turn = 0  # 0: a user message is due, 1: an assistant message
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {i} is a {type(message).__name__}, not an object with role and content"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {i} has role {role!r}; roles are {', '.join(ROLES)}"
        if not isinstance(content, str):
            return f"message {i} ({role}) has no string content (got {type(content).__name__})"
        if role == "system":
            if i != 0:
                return f"message {i} is a system message; only the first message may be one"
            continue
        expected = ("user", "assistant")[turn]
        if role != expected:
            return f"message {i} is from the {role}, but the {expected} is due (user and assistant take turns, " \
                   f"the user first)"
        turn = 1 - turn
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn from"
    return None


def turns(messages):
    """[(role, content)] of user and assistant messages, a system message folded into the first user message."""
    pairs = [(m["role"], m["content"]) for m in messages]
    if pairs and pairs[0][0] == "system":
        system, rest = pairs[0][1], pairs[1:]
        if rest:
            rest[0] = ("user", f"{system}\n\n{rest[0][1]}" if system else rest[0][1])
        pairs = rest
    return pairs


# ---------------------------------------------------------------------------------------------------- rendering
class ChatTokens:
    """The chat special tokens' ids in a tokenizer."""

    def __init__(self, tokenizer):
        self.bos = tokenizer.get_bos_token_id()
        self.user_start, self.user_end = (tokenizer.encode_special(n) for n in ("<|user_start|>", "<|user_end|>"))
        self.assistant_start, self.assistant_end = (tokenizer.encode_special(n) for n in
                                                    ("<|assistant_start|>", "<|assistant_end|>"))


def assemble(tokens, pairs, encoded):
    """(ids, mask) of turns `pairs` whose texts are already encoded (`encoded`, one id list per turn)."""
    ids, mask = [tokens.bos], [0]
    for (role, _), text_ids in zip(pairs, encoded):
        if role == "user":
            part, scored = [tokens.user_start, *text_ids, tokens.user_end], 0
            ids += part
            mask += [scored] * len(part)
        else:
            ids += [tokens.assistant_start, *text_ids, tokens.assistant_end]
            mask += [0] + [1] * (len(text_ids) + 1)  # the answer and its end: the model learns to stop
    return ids, mask


def render_conversation(tokenizer, messages):
    """(ids, mask) of a checked conversation: mask 1 on the tokens the loss falls on (the assistant's)."""
    pairs = turns(messages)
    return assemble(ChatTokens(tokenizer), pairs, [tokenizer.encode(text) for _, text in pairs])


def render_prompt(tokenizer, messages):
    """The ids a model answers the conversation's next turn from: the conversation, then <|assistant_start|>.
    messages: a conversation ending with a user message (a system message alone before it is allowed)."""
    problem = prompt_problem(messages)
    if problem:
        raise ChatDataError(problem)
    tokens = ChatTokens(tokenizer)
    pairs = turns(messages)
    ids, _ = assemble(tokens, pairs, [tokenizer.encode(text) for _, text in pairs])
    return ids + [tokens.assistant_start]


def prompt_problem(messages):
    """Why messages cannot be answered (checked as a conversation, with the last message the user's), or None."""
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and \
            messages[-1].get("role") == "user":
        probe = messages + [{"role": "assistant", "content": ""}]  # a conversation needs an assistant message
        return conversation_problem({"messages": probe})
    return conversation_problem({"messages": messages}) or "the last message must be the user's: it is what the " \
                                                           "model answers"


def render_many(tokenizer, conversations):
    """render_conversation of every conversation, their texts encoded in threaded batches (an iterator)."""
    tokens = ChatTokens(tokenizer)
    for start in range(0, len(conversations), ENCODE_CHUNK):
        chunk = [turns(messages) for messages in conversations[start:start + ENCODE_CHUNK]]
        flat = tokenizer.encode([text for pairs in chunk for _, text in pairs]) if chunk else []
        at = 0
        for pairs in chunk:
            yield assemble(tokens, pairs, flat[at:at + len(pairs)])
            at += len(pairs)


class Rendered:
    """Rendered conversations in two flat tensors (int32 ids, bool mask) and offsets: as Python lists of ints, a
    SmolTalk-sized set (~300M tokens) would take ~10 GB in every process. rendered[i] is (ids, mask) of one."""

    def __init__(self, pairs):
        ids, mask, lengths = [], [], []
        for conv_ids, conv_mask in pairs:
            ids.append(torch.as_tensor(conv_ids, dtype=torch.int32))
            mask.append(torch.as_tensor(conv_mask, dtype=torch.bool))
            lengths.append(len(conv_ids))
        self.ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
        self.mask = torch.cat(mask) if mask else torch.zeros(0, dtype=torch.bool)
        self.lengths = lengths
        self.offsets = [0]
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.mask[a:b]


# ---------------------------------------------------------------------------------------------------- reading
def read_conversations(spec):
    """The conversations (lists of messages) of a .jsonl file, hf:NAME[:config][:split] or `builtin` (the built set's
    training split, nanochat/data/chat_tasks.py), every one checked; the first malformed one raises ChatDataError
    naming its line (or row)."""
    if spec == BUILTIN:
        return builtin_conversations("train")
    if spec.startswith("hf:"):
        return read_hf_conversations(spec)
    if not spec.endswith(".jsonl"):
        raise ChatDataError(f"{spec}: expected a .jsonl file of {{\"messages\": [...]}} lines, hf:NAME or {BUILTIN}")
    conversations = []
    try:
        with open(spec, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
                    raise ChatDataError(f"{spec} line {lineno}: not valid JSON ({getattr(e, 'msg', e)})") from e
                problem = conversation_problem(record)
                if problem:
                    raise ChatDataError(f"{spec} line {lineno}: {problem}")
                conversations.append(record["messages"])
    except OSError as e:
        raise ChatDataError(f"{spec}: cannot read it ({e.strerror or e})") from e
    if not conversations:
        raise ChatDataError(f"{spec}: no conversations in it")
    return conversations


def read_hf_conversations(spec):
    """hf:NAME[:config][:split]: a dataset on the hub, or a directory written by datasets' save_to_disk, with a
    `messages` column (SmolTalk's layout)."""
    fields = spec[len("hf:"):].split(":")
    if len(fields) > 3 or not fields[0]:
        raise ChatDataError(f"{spec}: expected hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT")
    name, config, split = (fields + ["", ""])[:3]
    import datasets  # lazy: ~1.2 s to import, and only hf: needs it
    try:
        if os.path.isdir(name) and saved_by_datasets(name):
            data = datasets.load_from_disk(name)
            if isinstance(data, datasets.DatasetDict):
                if (split or "train") not in data:
                    raise ChatDataError(f"{spec}: no split {split or 'train'!r}; it has {', '.join(data)}")
                data = data[split or "train"]
        else:
            data = datasets.load_dataset(name, config or None, split=split or "train")
    except (OSError, ValueError) as e:  # not found, offline, bad config or split: datasets says which
        if isinstance(e, ChatDataError):
            raise
        raise ChatDataError(f"{spec}: {type(e).__name__}: {e}") from e
    if "messages" not in (data.column_names or []):
        raise ChatDataError(f"{spec}: no 'messages' column; its columns are: {', '.join(data.column_names or [])}")
    conversations = []
    for row, messages in enumerate(data["messages"]):
        problem = conversation_problem({"messages": messages})
        if problem:
            raise ChatDataError(f"{spec} row {row}: {problem}")
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not conversations:
        raise ChatDataError(f"{spec}: no conversations in it")
    return conversations


def fingerprint(conversations):
    """A short hash of the conversations' turns: equal iff they render alike under every tokenizer."""
    h = hashlib.sha256()
    for messages in conversations:
        h.update(json.dumps(turns(messages), ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()[:12]


# ---------------------------------------------------------------------------------------------------- packing
def pack_rows(rendered, order, start, B, width):
    """B rows of `width` tokens from the conversations rendered[order[start]], ... : (ids (B, width), mask, the index
    in order after the last conversation placed). A row holds whole conversations while they fit; one longer than a
    row alone is cut to it. order must be long enough: the caller supplies the next epoch's order after this one."""
    ids = torch.full((B, width), UNSCORED, dtype=torch.int32)
    mask = torch.zeros((B, width), dtype=torch.bool)
    at = start
    for row in range(B):
        filled = 0
        while filled < width and at < len(order):
            conv_ids, conv_mask = rendered[order[at]]
            if filled and len(conv_ids) > width - filled:
                break  # it starts the next row rather than being cut
            take = min(len(conv_ids), width - filled)
            ids[row, filled:filled + take] = torch.as_tensor(conv_ids[:take], dtype=torch.int32)
            mask[row, filled:filled + take] = torch.as_tensor(conv_mask[:take], dtype=torch.bool)
            filled, at = filled + take, at + 1
    return ids, mask, at


def to_inputs_targets(ids, mask):
    """(inputs, targets) of packed rows: targets are the next tokens where the mask scores them, UNSCORED elsewhere;
    the padding's inputs any valid id (0), its outputs unscored."""
    inputs = ids[:, :-1].clamp(min=0).long()
    targets = torch.where(mask[:, 1:], ids[:, 1:], UNSCORED).long()
    return inputs.contiguous(), targets.contiguous()


class ChatLoader:
    """Training batches (inputs, targets) of data rank `rank` of `world_size`: this rank's share of each epoch's
    shuffled conversations (positions rank, rank + world_size, ...), packed B rows of T + 1 tokens at a time."""

    def __init__(self, rendered, B, T, rank, world_size, seed, device="cpu", resume_state=None):
        self.rendered, self.B, self.T = rendered, B, T
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        if len(rendered) < world_size:
            raise ChatDataError(f"{len(rendered)} training conversations for {world_size} data ranks (processes x "
                                f"accumulation steps): every rank needs at least one; add conversations or lower "
                                f"--gradient_accumulation_steps")
        self.shares = {}  # epoch -> this rank's share: the current epoch's and the next few
        self.position = {"epoch": 0, "index": 0}
        if resume_state:
            self.position = self.check_state(resume_state)

    def share(self, epoch):
        """This rank's conversation indices of an epoch, in order."""
        if epoch not in self.shares:
            order = list(range(len(self.rendered)))
            random.Random(f"chat:{self.seed}:{epoch}").shuffle(order)
            self.shares = {e: s for e, s in self.shares.items() if e >= self.position["epoch"]}
            self.shares[epoch] = order[self.rank::self.world_size]
        return self.shares[epoch]

    def check_state(self, state):
        if not isinstance(state, dict) or set(state) != {"epoch", "index"} or \
                not all(isinstance(state[k], int) and state[k] >= 0 for k in state):
            raise ValueError(f"resume_state {state!r} is not a chat loader's position (epoch, index)")
        if state["index"] >= len(self.share(state["epoch"])):
            raise ValueError(f"resume_state points at conversation {state['index']} of rank {self.rank}'s share, "
                             f"which holds {len(self.share(state['epoch']))}: the conversations changed")
        return dict(state)

    def state_dict(self):
        """Where the next batch starts; JSON-serialisable."""
        return dict(self.position)

    def __iter__(self):
        return self

    def __next__(self):
        epoch, index = self.position["epoch"], self.position["index"]
        order, epochs = list(self.share(epoch)), 1
        while len(order) - index < self.B * (self.T + 1):  # enough conversations ahead for the rows (each >= 1 token)
            order += self.share(epoch + epochs)
            epochs += 1
        ids, mask, at = pack_rows(self.rendered, order, index, self.B, self.T + 1)
        for _ in range(epochs):  # the position in the epoch the next conversation belongs to
            length = len(self.share(epoch))
            if at < length:
                break
            epoch, at = epoch + 1, at - length
        self.position = {"epoch": epoch, "index": at}
        inputs, targets = to_inputs_targets(ids, mask)
        return inputs.to(self.device), targets.to(self.device)


def rows_per_epoch(lengths, T, seed):
    """Rows of T + 1 tokens one epoch of conversations of these lengths packs into (one stream, epoch 0's order, as
    pack_rows packs): sizes a run of --num_epochs."""
    order = list(range(len(lengths)))
    random.Random(f"chat:{seed}:0").shuffle(order)
    rows, filled = 0, 0
    for i in order:
        if filled and lengths[i] > T + 1 - filled:
            rows, filled = rows + 1, 0
        filled = min(T + 1, filled + lengths[i])
    return rows + (filled > 0)


# ---------------------------------------------------------------------------------------------------- the data source
class ChatData:
    """chat_sft's training data, as nanochat/trainer.py reads a data source: its identity (recorded in every
    checkpoint and checked on resume), the training loaders, the validation batches and the sample prompts.

    train, val: lists of conversations; without val, one in VAL_EVERY of train is held out (drawn with the seed)."""

    def __init__(self, tokenizer, max_seq_len, spec, train, val=None, val_spec=None, seed=0):
        if val is None:
            # drawn, not every k-th: a file whose tasks alternate would otherwise validate on one task alone
            held = set(random.Random(f"chat-val:{seed}").sample(range(len(train)), len(train) // VAL_EVERY)) or \
                ({len(train) - 1} if len(train) > 1 else set())
            val = [train[i] for i in sorted(held)] or list(train)  # one conversation alone validates on itself
            train = [c for i, c in enumerate(train) if i not in held]
        self.spec, self.val_spec, self.seed, self.T = spec, val_spec, seed, max_seq_len
        self.train_conversations, self.val_conversations = train, val
        self.train = self.scored(render_many(tokenizer, train), "training")
        self.val = self.scored(render_many(tokenizer, val), "validation")
        both = hashlib.sha256(f"{fingerprint(train)}:{fingerprint(val)}".encode()).hexdigest()[:12]
        self.record = {"fingerprint": both, "dir": spec if val_spec is None else f"{spec} (validation: {val_spec})",
                       "shards": 1, "conversations": len(train), "val_conversations": len(val)}
        prompts = [c[:next(i for i in range(len(c)) if c[i]["role"] == "assistant")] for c in val[:4]]
        self.sample_prompts = [render_prompt(tokenizer, p) for p in prompts]

    def problem(self):
        return None  # read and checked when built

    def identity(self):
        """meta.json's "data": a fingerprint of the conversations (checked on --resume), where they came from."""
        return dict(self.record)

    def scored(self, rendered, what):
        """The rendered conversations (Rendered) with an assistant token within the first row: the rest could never
        train, and a batch of them alone would have nothing to score."""
        left_out = []

        def scorable():
            for ids, mask in rendered:
                if any(mask[1:self.T + 1]):
                    yield ids, mask
                else:
                    left_out.append(1)
        kept = Rendered(scorable())
        left_out = len(left_out)
        if not len(kept):
            raise ChatDataError(f"{self.spec}: no {what} conversation has an assistant token within the first "
                                f"{self.T} tokens (--max_seq_len of the base model): nothing to train on")
        if left_out:
            print0(f"WARNING: {left_out} {what} conversation(s) left out: their first assistant token lies beyond "
                   f"the {self.T}-token row")
        return kept

    def loaders(self, run_config, tokenizer, rank, resume_states, device="cpu"):
        """Process `rank`'s loaders, one per accumulation step (data rank rank * grad_accum + j), at their positions."""
        accum, world = run_config.grad_accum, run_config.world_size * run_config.grad_accum
        return [ChatLoader(self.train, run_config.device_batch_size, run_config.max_seq_len, rank * accum + j, world,
                           self.seed, device, state) for j, state in enumerate(resume_states)]

    def steps_per_epoch(self, run_config):
        rows_per_step = run_config.device_batch_size * run_config.world_size * run_config.grad_accum
        rows = rows_per_epoch(self.train.lengths, run_config.max_seq_len, self.seed)
        return max(1, math.ceil(rows / rows_per_step))

    def validation(self, tokenizer, B, T, num_tokens, rank, world_size, device="cpu"):
        """(a function returning this rank's validation batches, how many): the validation conversations packed in
        order, at most num_tokens // T rows, batches dealt out to the ranks in turn (a rank short of one gets a
        batch with nothing scored, so every rank runs alike)."""
        rows, order, at = [], list(range(len(self.val))), 0
        while at < len(order) and len(rows) < max(1, num_tokens // T):
            ids, mask, at = pack_rows(self.val, order, at, 1, T + 1)
            rows.append(to_inputs_targets(ids, mask))
        batches = [rows[i:i + B] for i in range(0, len(rows), B)]
        steps = math.ceil(len(batches) / world_size)

        def mine():
            for i in range(steps):
                k = i * world_size + rank
                x, y = (torch.cat([r[0] for r in batches[k]]), torch.cat([r[1] for r in batches[k]])) \
                    if k < len(batches) else (torch.zeros(1, T, dtype=torch.long), torch.full((1, T), UNSCORED))
                yield x.to(device), y.to(device)
        return mine, steps


def load_chat_data(tokenizer, max_seq_len, spec, val_spec=None, seed=0):
    """ChatData of --data (and --val_data): every conversation read and checked before anything is written."""
    train = read_conversations(spec)
    val = read_conversations(val_spec) if val_spec else None
    return ChatData(tokenizer, max_seq_len, spec, train, val, val_spec, seed)
