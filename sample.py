"""
sample.py -- watch speculative decoding work: one prompt, one drafter, every round shown.

speculative.py is the loop; this is its command line (nanoGPT's sample.py): it loads the target
and a drafter from train.py's out/ folder, generates, and prints the text with each round's
accepted drafts in green, the target's corrections in red and its free bonus tokens in blue,
then tau and the acceptance by draft position.

    python sample.py --prompt "def parse(" --method dflash
    python sample.py --prompt "def parse(" --method dspark --tree 20   # a token tree (tree.py)
    python sample.py --chat "Why is the sky blue?" --method lookup --out-dir out-smollm2

With --chat the target is asked a question in its own chat format (an instruct model imported with
train.py --init-from: formats/chat.py), the answer ends at its end-of-turn token, and plain
decoding answers too, to show the same tokens and what the drafts saved.
"""

import os
import sys
import time

from benchmark.flags import ARITHMETIC, ARITHMETIC_HELP
from formats.chat import Chat
from registry import drafters as registry
from runtime import cpu_speed
from formats import gguf_int4, tokenizer
from runtime.checkpoint import CheckpointError
from runtime.command import run
from runtime.devices import pick_device, synchronize
from runtime.profiling import most_tree_nodes, profile_tree
from runtime.settings import (ArgumentParser, add_sampling_flags, number, parse_args, path_arg,
                              text_arg)
from sampler import Sampler
from speculative import generate_plain, generate_speculative, k_for
from training import data
from tree import BlockTree, generate_tree


def show(enc, prompt_ids, trace, color, echo=True):
    """Prompt (unless not `echo`), then each round: accepted drafts (green), the target's own
    token (red if it corrected a draft, blue if it was a free bonus after full acceptance, plain
    if nothing was drafted that round: `full` is None)."""
    if color:
        G, R, B, Z = "\033[32m", "\033[31;1m", "\033[34;1m", "\033[0m"
    else:
        G, R, B, Z = "", "[", "{", ""
    ids, shown = list(prompt_ids), [enc.decode(prompt_ids)]  # shown: the whole text so far

    def piece(new):
        """The text `new` ids add, decoded with every id before them: a tokenizer may join a
        token to the one before it (SentencePiece's leading spaces)."""
        ids.extend(new)
        whole = enc.decode(ids)
        added, shown[0] = whole[len(shown[0]):], whole
        return added
    parts = [shown[0]] if echo else []
    for acc, tok, full in trace:
        if acc:
            parts.append(G + piece(acc) + Z)
        if full is None:  # a round with no draft (prompt lookup found no match): a plain step
            parts.append(piece([tok]))
            continue
        close = (Z if color else ("}" if full else "]"))
        parts.append((B if full else R) + piece([tok]) + close)
    return "".join(parts)


def build_parser():
    p = ArgumentParser(description="Generate text with speculative decoding and show what was "
                                   "drafted and kept.")
    p.add_argument("--prompt", default=None, type=text_arg,
                   help="the text to continue (default: 'def parse(')")
    p.add_argument("--chat", default=None, metavar="QUESTION", type=text_arg,
                   help="instead, ask a chat model this, in its own chat format; the answer ends "
                   "at its end of turn (default: none)")
    p.add_argument("--method", choices=registry.names(), default=registry.names()[0],
                   help="the drafter (default: %(default)s)")
    p.add_argument("--k", type=number(int, 1), default=None,
                   help="tokens drafted per round (default: the drafter's own)")
    p.add_argument("--hybrid-with", choices=registry.partners(), default=None,
                   help="with --method hybrid: the learned drafter it pairs with prompt lookup "
                   f"(default: {registry.default_partner()})")
    p.add_argument("--tree", type=number(int, 0), default=0,
                   help=f"with --method {' or '.join(registry.tree_drafters())}: verify a token "
                   "tree of at most this many nodes, sized each round by what it is expected to "
                   "keep and costs here (tree.py; default: 0, a chain)")
    p.add_argument("--max-new-tokens", type=number(int, 1), default=None,
                   help="the most tokens to generate (default: 96; with --chat 256)")
    add_sampling_flags(p)
    p.add_argument("--arithmetic", default="auto", choices=ARITHMETIC,
                   help=ARITHMETIC_HELP + " (default: %(default)s)")
    p.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or mps (default: %(default)s)")
    p.add_argument("--out-dir", type=path_arg("checkpoints"), default="out",
                   help="where train.py put the checkpoints (default: %(default)s)")
    p.add_argument("--no-color", action="store_true",
                   help="mark tokens with [correction] and {bonus} instead of colors (default: "
                   "colors on a terminal)")
    return p


def check_pairings(a):
    """Flags that cannot apply together, refused before anything loads."""
    if a.chat is not None and a.prompt is not None:
        raise ValueError("--chat asks a question in the model's chat format, --prompt gives text "
                         "to continue: give one of them")
    if a.chat is not None and not a.chat.strip():
        raise ValueError("--chat is empty: ask a question")
    built_around = registry.built_around()
    if a.hybrid_with and a.method not in built_around:
        raise ValueError(f"--hybrid-with picks the learned drafter {' or '.join(built_around)} "
                         f"pairs with: use it with --method {' or '.join(built_around)}, not "
                         f"{a.method}")
    if a.tree and not registry.entry(a.method).declared.trees:
        raise ValueError(f"--tree grows a block drafter's tree: use it with --method "
                         f"{' or '.join(registry.tree_drafters())}, not {a.method}")
    if a.tree and a.sampling == "rejection":
        raise ValueError("--tree keeps greedy and coupled sampling exact; rejection sampling over "
                         "a tree needs a multi-candidate rule (SpecInfer's) that is not built: use "
                         "--sampling greedy or coupled")


def main(argv=None):
    a = parse_args(build_parser(), argv)
    check_pairings(a)
    cpu_speed.enable()
    device = pick_device(a.device)
    path = os.path.join(a.out_dir, "target.pt")
    target, target_ckpt, _, a.arithmetic_ran, _ = gguf_int4.decoding_target(path, a.arithmetic,
                                                                            device)
    chat = Chat.of_target(target_ckpt, path, "--chat") if a.chat is not None else None
    # every data file checked, and the tokenizer the target was trained with
    enc = tokenizer.encoding_of(data.load_build_for(target_ckpt, a.out_dir))
    drafter = registry.load_drafter(a.method, a.out_dir, target, target_ckpt, device,
                                    target.lm_head.weight.dtype, sampling=a.sampling,
                                    partner=a.hybrid_with)
    sampler = Sampler(a.sampling, a.temperature, a.top_k, a.seed, device)
    text = "def parse(" if a.prompt is None else a.prompt
    ids = chat.prompt(enc, a.chat) if chat else tokenizer.encode(enc, text)
    stop = set(chat.stop) if chat else set()
    a.max_new_tokens = a.max_new_tokens or (256 if chat else 96)
    a.k = a.k if a.k is not None else k_for(drafter, a.sampling)
    trace, t0 = [], time.perf_counter()
    if a.tree:  # sized each round by what it is expected to keep and what it costs here
        if a.tree > most_tree_nodes(target):
            print(f"--tree {a.tree}: at most {most_tree_nodes(target)} nodes, what a round can "
                  f"verify in the target's {target.config.sequence_len}-token window")
            a.tree = most_tree_nodes(target)
        tree = profile_tree(BlockTree(drafter, nodes=a.tree, k=a.k), target)
        t0 = time.perf_counter()
        out, stats = generate_tree(target, tree, ids, a.max_new_tokens, sampler, trace=trace,
                                   stop=stop)
    else:
        out, stats = generate_speculative(target, drafter, ids, a.max_new_tokens, a.k, sampler,
                                          trace=trace, sync=lambda: synchronize(device), stop=stop)
    seconds = time.perf_counter() - t0
    color = sys.stdout.isatty() and not a.no_color
    if chat:
        print(f"user: {a.chat}\nassistant: ", end="")
    print(show(enc, ids, [([], out[0], False)] + trace, color, echo=not chat))
    print()
    if out[-1] in stop:
        print("(the answer ended with the model's end-of-turn token)")
    elif len(out) < a.max_new_tokens:
        print(f"(stopped at the context limit: prompt + generated = {len(ids) + len(out)} tokens, "
              f"the target's context window)")
    report(a, stats, tree.sizes if a.tree else None, color)
    if chat:  # the lesson's promise, shown: plain decoding writes the very same answer
        t0 = time.perf_counter()
        plain = generate_plain(target, ids, a.max_new_tokens,
                               Sampler(a.sampling, a.temperature, a.top_k, a.seed, device),
                               stop=stop)
        alone = time.perf_counter() - t0
        same = "the same tokens" if plain == out else "OTHER tokens (rejection sampling draws " \
            "from the same distribution, not the same tokens)" if a.sampling == "rejection" \
            else "OTHER tokens: a float32 near-tie rounded apart (bench.py reports the margin)"
        print(f"plain decoding: {same}, {len(plain)} in {alone:.2f} s; {a.method}: "
              f"{seconds:.2f} s ({alone / seconds:.2f}x, one run each: bench.py measures)")


def report(a, stats, sizes, color):
    """tau, the acceptance by draft position, the tree's sizes and the time split."""
    shape = f", a tree of at most {a.tree} nodes" if a.tree else ""
    print(f"arithmetic: {a.arithmetic_ran}")
    print(f"method {a.method}{shape}, k={a.k}, {a.sampling}: {stats.tokens} tokens in "
          f"{stats.target_forwards} target forwards, tau = {stats.tau:.2f}")
    print("acceptance by draft position: " + " ".join(f"{x:.0%}" for x in stats.acceptance()))
    if sizes is not None:
        print(f"tree nodes, the rounds it grew (the others drafted its chain): "
              f"{' '.join(map(str, sizes))}")
    print(f"time: draft {stats.draft_time * 1000:.0f} ms, verify {stats.verify_time * 1000:.0f} ms")
    if color:
        legend = "green = accepted draft, red = target's correction, blue = target's bonus"
    else:
        legend = "plain = accepted draft, [x] = target's correction, {x} = target's bonus"
    print(legend)


if __name__ == "__main__":
    run(main, errors=(CheckpointError, ValueError))
