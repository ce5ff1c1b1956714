"""
training/chat_set.py -- the distillation set of a chat model: requests a user might send, drawn
from what every Python install has, answered by the target itself.

A chat model's drafter must learn what the model says when asked something: its answers, in its
chat template, not continuations of raw source files. The requests come from the standard
library (each public function with a docstring becomes "write", "complete", "explain" or "what
does it do" requests) and from pydoc's topics (the language reference, section by section), so
nothing is downloaded and none of them is a benchmark's prompt. The target answers them in
batches, greedily, to its end of turn or --gen-tokens, and the conversations are kept in
out/chat_set.pt, written after every batch: an interrupted run goes on where it stopped.
training/distill.py packs them into the training windows every drafter stage reads.
"""

import ast
import copy
import functools
import pathlib
import random
import sysconfig
import time

import torch

from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from serving.batched import generate_plain_batched
from speculative import Sampler
from training import data

BATCH = 64  # requests answered at once (plain batched decoding: more rows, more tokens a second)
saved = None  # while the set is being answered: (answers kept, answers wanted, the file), for Ctrl-C

# how a function becomes a request: a Python user's four usual asks
ASKS = (
    "Write a Python function `{name}({args})` that does this: {doc}",
    "Complete this Python function. Reply with the whole function in a code block.\n\n"
    "```python\ndef {name}({args}):\n    \"\"\"{doc}\"\"\"\n```",
    "Explain what this Python function does, then show how to call it.\n\n```python\n{source}\n```",
    "What does `{module}.{name}` in Python's standard library do? Give a short example.",
)
TOPIC_ASK = "Explain this part of the Python language reference simply, with an example:\n\n{text}"


@functools.lru_cache(maxsize=1)
def stdlib_functions():
    """[(module, name, args, first docstring paragraph, source)] of the standard library's public
    functions that have a docstring, read with ast (nothing is imported, so nothing runs)."""
    root, out = pathlib.Path(sysconfig.get_paths()["stdlib"]), []
    for path in data.stdlib_files():  # the corpus's files, less IDLE's and the test helpers
        rel = path.relative_to(root)
        if "idlelib" in rel.parts or any(p.startswith("test") for p in rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    src = ast.get_source_segment(text, node) or ""
                    out.append((module, node.name, ast.unparse(node.args),
                                doc.split("\n\n")[0].replace("\n", " "), src))
    return out


def requests(n, seed):
    """n requests, the same for a seed: the functions' four asks in turn, and one in ten a topic
    of the language reference."""
    from pydoc_data.topics import topics
    rng = random.Random(seed)
    funcs, topic_texts = stdlib_functions(), [t.strip()[:700] for t in topics.values()]
    funcs = list(funcs)
    rng.shuffle(funcs)
    out = []
    for i in range(n):
        if i % 10 == 9:
            out.append(TOPIC_ASK.format(text=topic_texts[(i // 10) % len(topic_texts)]))
            continue
        module, name, args, doc, src = funcs[i % len(funcs)]
        ask = ASKS[i % len(ASKS)]
        if "{source}" in ask and len(src) > 800:
            ask = ASKS[0]  # a long body would crowd the window: ask for it to be written
        out.append(ask.format(module=module, name=name, args=args, doc=doc[:400], source=src))
    return out


def check_room(max_new, window):
    """The tokens a request keeps before an answer of up to max_new in the window (at least one),
    or an error naming the flags: train.py asks it before anything runs (training/flags.py)."""
    if max_new >= window:
        raise ValueError(f"answers of up to --gen-tokens {max_new} leave no room for a request in "
                         f"a --block-size {window} window: lower --gen-tokens (below {window}; a "
                         "request and its answer share the window) or raise --block-size")
    return window - max_new


def answered(path, want, vocab_size):
    """The conversations kept in `path` for these settings (an interrupted run's part), or []."""
    try:
        ck = load_checkpoint(path, "chat_set")
    except CheckpointError:  # none yet, or unreadable: it is only a cache
        return []
    convs = ck["conversations"] if ck.get("settings") == want else []
    if any(t < 0 or t >= vocab_size for c in convs for t in c):
        print(f"chat set: {path} holds token ids outside the target's {vocab_size}; answering "
              "anew")
        return []
    return convs


def write(target, chat, enc, n, max_new, seed, path, want, dtype=torch.float32):
    """out/chat_set.pt: n requests (requests()) in the target's chat template, each with the
    target's greedy answer, up to max_new tokens and its end of turn -> [prompt + answer token
    lists]. Answered BATCH at a time, shortest prompts together; the file is rewritten after
    every batch, so a rerun starts at the first batch not written. dtype: the copy of the target
    that answers (bfloat16 where this CPU runs it faster than float32)."""
    room = check_room(max_new, target.config.sequence_len)
    convs = answered(path, want, target.config.vocab_size)
    if len(convs) >= n:
        return convs[:n]
    prompts = sorted((chat.prompt(enc, q) for q in requests(n, seed)), key=len)
    prompts = [p[-room:] for p in prompts]  # the end of a long request: its question
    if convs:
        print(f"chat set: {len(convs)}/{n} answers kept in {path}; answering the rest")
    model = target if dtype == torch.float32 else copy.deepcopy(target).to(dtype)
    t0, done0, tokens = time.time(), len(convs), 0
    global saved
    saved = (len(convs), n, path)
    for i in range(len(convs), n, BATCH):
        batch = prompts[i:i + BATCH]
        answers = generate_plain_batched(model, batch, max_new, Sampler("greedy"),
                                         stop=tuple(chat.stop))
        convs += [p + a for p, a in zip(batch, answers)]
        tokens += sum(len(a) for a in answers)
        save_checkpoint({"kind": "chat_set", "settings": want, "state_dict": {},
                         "conversations": convs}, path)
        saved = (len(convs), n, path)
        rate = tokens / (time.time() - t0)
        left = (n - len(convs)) / max(1, len(convs) - done0) * (time.time() - t0)
        print(f"chat set | {len(convs):5d}/{n} answers | {rate:5.0f} answer tok/s | "
              f"ETA {int(left // 60)}m{int(left % 60):02d}s", flush=True)
    saved = None
    return convs


def packed(convs, T):
    """The conversations, in order, end to end into (N, T) training windows (the last partial
    window dropped; a conversation longer than a window is cut at its end). Too few for one
    window: an error naming the flag (the answers stay kept)."""
    flat = [t for c in convs for t in c[:T]]
    N = len(flat) // T
    if N < 1:
        raise ValueError(f"the chat set's {len(convs)} conversations hold {len(flat)} tokens, "
                         f"less than one {T}-token training window: raise --gen-seqs (to about "
                         f"{max(2, -(-2 * T * len(convs) // max(1, len(flat))))}; the answers so "
                         "far are kept)")
    return torch.tensor(flat[:N * T], dtype=torch.long).view(N, T)
