"""
benchmark/quality.py -- what decoding a GGUF target in its own int4 codes (formats/gguf_int4.py)
costs in quality, beside the same file's weights dequantized to float32: the perplexity on the
validation text, and plain decoding's answers to a prompt set, how many word for word float32's
(and llama.cpp's, where llama-cpp-python is installed).

    python -m benchmark.quality --out-dir out-smollm2                       # the chat questions
    python -m benchmark.quality --out-dir out-smollm2 --prompts humaneval-chat --n-prompts 40
"""

import math
import os
import sys

import numpy as np
import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark import peers, prompt_sets
from formats.chat import Chat
from runtime import cpu_speed
from formats import gguf_int4, tokenizer
from runtime.checkpoint import CheckpointError
from runtime.command import run
from runtime.settings import ArgumentParser, number, path_arg
from runtime.target import load_target
from sampler import Sampler
from speculative import generate_plain
from training import data


@torch.inference_mode()
def perplexity(model, val, windows, length):
    """exp(mean next-token loss) over `windows` windows of `length` tokens spread over val."""
    starts = np.linspace(0, len(val) - length - 1, windows).astype(np.int64)
    losses = [model(torch.from_numpy(val[s:s + length][None]),
                    torch.from_numpy(val[s + 1:s + length + 1][None]))[1].item()
              for s in starts]
    return math.exp(sum(losses) / len(losses))


def answers(model, prompts, n, stop):
    return [generate_plain(model, p, n, Sampler("greedy"), stop=stop) for p in prompts]


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def build_parser():
    p = ArgumentParser(prog="python -m benchmark.quality",
                       description="Perplexity and answers of a GGUF target in int4 against "
                       "float32 (and llama.cpp's answers where it is installed).")
    p.add_argument("--out-dir", type=path_arg("checkpoints"), default="out",
                   help="where train.py put the target imported from a GGUF (default: "
                   "%(default)s)")
    p.add_argument("--prompts", default="chat",
                   help="chat, humaneval-chat or a JSONL file of questions (default: %(default)s)")
    p.add_argument("--n-prompts", type=number(int, 1), default=None,
                   help="the first N prompts of the set (default: all)")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=256,
                   help="the longest answer (default: %(default)s)")
    p.add_argument("--windows", type=number(int, 1), default=32,
                   help="validation windows the perplexity reads (default: %(default)s)")
    p.add_argument("--window", type=number(int, 2), default=512,
                   help="tokens per validation window (default: %(default)s)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    cpu_speed.enable()
    path = os.path.join(a.out_dir, "target.pt")
    target, ckpt = load_target(path)
    q, what = gguf_int4.pick(target, ckpt, "int4", "cpu", torch.float32)
    build = data.load_build_for(ckpt, a.out_dir)
    enc = tokenizer.encoding_of(build)
    val = np.fromfile(build["val_bin"], dtype=build["token_dtype"]).astype(np.int64)
    length = min(a.window, target.config.sequence_len - 1)
    print(f"int4: {what}")
    ppl = {name: perplexity(m, val, a.windows, length) for name, m in (("float32", target),
                                                                        ("int4", q))}
    print(f"perplexity on {a.windows} validation windows of {length} tokens: float32 "
          f"{ppl['float32']:.4f}, int4 {ppl['int4']:.4f} "
          f"({100 * (ppl['int4'] / ppl['float32'] - 1):+.2f}%)")
    prompts, stop = prompt_sets.asked(prompt_sets.requests_of(a.prompts), enc,
                                      lambda: Chat.of_target(ckpt, path, "--prompts"))
    prompts = prompts[:a.n_prompts]
    texts = {"float32": answers(target, prompts, a.max_new_tokens, stop),
             "int4": answers(q, prompts, a.max_new_tokens, stop)}
    try:
        cpp = peers.llama_cpp_engines(ckpt["init_from"], target.config.sequence_len,
                                      torch.get_num_threads())["plain"]
        texts["llama.cpp"] = [peers.llama_cpp_generate(cpp, p, a.max_new_tokens, stop)
                              for p in prompts]
    except ImportError:
        print("llama.cpp: not installed (llama-cpp-python), its answers are not compared")
    names = list(texts)
    print(f"plain decoding's answers to {len(prompts)} {a.prompts} prompts, up to "
          f"{a.max_new_tokens} tokens: prompts whose answers are identical (where they differ, "
          "the median token they first differ at)")
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            same = sum(u == v for u, v in zip(texts[x], texts[y]))
            at = sorted(first_difference(u, v) for u, v in zip(texts[x], texts[y]) if u != v)
            where = f" (first difference at token {at[len(at) // 2]})" if at else ""
            print(f"  {x} and {y}: {same}/{len(prompts)}{where}")
    return ppl, texts


if __name__ == "__main__":
    run(main, errors=(CheckpointError, ValueError, data.DataError))
