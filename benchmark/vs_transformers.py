"""
benchmark/vs_transformers.py -- nanospec's prompt lookup against transformers' own, on the same
weights.

draft_lookup.py built prompt lookup from scratch; this script checks it against the
implementation most people would reach for, Hugging Face transformers' `generate(...,
prompt_lookup_num_tokens=...)`. The nanospec target is copied into a `GPT2LMHeadModel` (same
architecture: learned positions, pre-LayerNorm, the GELU its config names, tied head), so both
decode the very same model; then plain greedy and prompt lookup run in each, interleaved, on
the same prompts, in one process, on the same threads and dtype (float32).

It needs transformers, which nanospec itself does not (`pip install transformers`); nothing
is downloaded, the model comes from out/target.pt.

    python -m benchmark.vs_transformers                           # the outside-corpus prompts
    python -m benchmark.vs_transformers --prompts my.jsonl --repeats 5
"""

import os
import statistics
import sys
import time

import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from training import data
from benchmark.prompt_sets import read_jsonl
from runtime.command import run
from runtime.checkpoint import CheckpointError
from draft_lookup import LookupDrafter
from gpt import GPTConfig
from runtime.settings import ArgumentParser, number, path_arg
from training.target import load_target
from speculative import Sampler, generate_plain, generate_speculative

# -----------------------------------------------------------------------------
# the same model, as transformers' GPT-2


def to_transformers(target):
    """A GPT2LMHeadModel holding the target's weights (its Conv1D stores Linear weights
    transposed)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    c = target.config
    cfg = GPT2Config(vocab_size=c.vocab_size, n_positions=c.sequence_len, n_embd=c.n_embd,
                     n_layer=c.n_layer, n_head=c.n_head, activation_function=c.activation,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                     bos_token_id=None, eos_token_id=None)
    hf = GPT2LMHeadModel(cfg).eval()
    sd = {}
    for name, w in target.state_dict().items():
        linear = name.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight"))
        if linear and name.startswith("transformer.h."):
            w = w.t()
        sd[name] = w
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if unexpected or any(not m.endswith(("attn.bias", "attn.masked_bias")) for m in missing):
        raise ValueError(f"weights do not map onto GPT-2: missing {missing}, "
                         f"unexpected {unexpected}")
    # no end-of-text stop: both sides generate exactly n tokens
    hf.generation_config.pad_token_id = 0
    hf.generation_config.eos_token_id = None
    return hf


def hf_generate(hf, prompt, n, lookup=None, ngram=2):
    x = torch.tensor([prompt])
    kw = dict(prompt_lookup_num_tokens=lookup, max_matching_ngram_size=ngram) if lookup else {}
    with torch.inference_mode():
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, **kw)
    return out[0, len(prompt):].tolist()


# -----------------------------------------------------------------------------


def build_parser():
    p = ArgumentParser(prog="python -m benchmark.vs_transformers",
                       description="nanospec's prompt lookup against transformers' prompt lookup, "
                                   "same weights.")
    p.add_argument("--out-dir", type=path_arg("checkpoints"), default="out",
                   help="where train.py put target.pt and the tokenizer (default: %(default)s)")
    p.add_argument("--prompts", type=path_arg("in"), default="prompts/outside.jsonl",
                   help='JSONL file of {"prompt": "..."} lines (default: %(default)s)')
    p.add_argument("--max-new-tokens", type=number(int, 1), default=128,
                   help="tokens generated per prompt (default: %(default)s)")
    p.add_argument("--lookup-tokens", type=number(int, 1), default=10,
                   help="transformers' prompt_lookup_num_tokens (default: %(default)s, its "
                   "documented example's)")
    p.add_argument("--ngram", type=number(int, 1), default=2,
                   help="transformers' max_matching_ngram_size (its default: 2)")
    p.add_argument("--repeats", type=number(int, 1), default=3,
                   help="timed passes over all prompts per method (default: %(default)s)")
    p.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        import transformers
    except ImportError:
        raise SystemExit("error: this comparison needs transformers: "
                         "pip install transformers") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    target, target_ckpt = load_target(os.path.join(args.out_dir, "target.pt"), "cpu")
    if not isinstance(target.config, GPTConfig):
        raise ValueError(f"{args.out_dir}/target.pt is a {type(target).__name__}: this comparison "
                         "copies a GPT-2 target into transformers' GPT2LMHeadModel, and reads no "
                         "other family")
    # every data file checked, and the tokenizer the target was trained with
    enc = data.encoding_of(data.load_build_for(target_ckpt, args.out_dir))
    prompts = read_jsonl(args.prompts, enc)
    longest = max(len(p) for p in prompts)
    if longest >= target.config.sequence_len:
        raise ValueError(f"a prompt has {longest} tokens but the context window is "
                         f"{target.config.sequence_len}")
    n = min(args.max_new_tokens, target.config.sequence_len - longest)
    hf = to_transformers(target)
    ours = LookupDrafter(target.config.vocab_size)
    same_as_hf = LookupDrafter(target.config.vocab_size, max_ngram=args.ngram)
    methods = {
        "transformers plain": lambda p: hf_generate(hf, p, n),
        "transformers lookup": lambda p: hf_generate(hf, p, n, args.lookup_tokens, args.ngram),
        "nanospec plain": lambda p: generate_plain(target, p, n, Sampler("greedy")),
        "nanospec lookup": lambda p: generate_speculative(target, ours, p, n, ours.default_k,
                                                          Sampler("greedy"))[0],
        f"nanospec lookup (k={args.lookup_tokens}, n<={args.ngram})":
            lambda p: generate_speculative(target, same_as_hf, p, n, args.lookup_tokens,
                                           Sampler("greedy"))[0],
    }
    for fn in methods.values():  # warm-up
        fn(prompts[0])
    times, outs = {m: [] for m in methods}, {}
    for rep in range(args.repeats):
        for m, fn in methods.items():  # interleaved, so drift hits every method alike
            t0 = time.perf_counter()
            outs[m] = [fn(p) for p in prompts]
            times[m].append(time.perf_counter() - t0)
        print(f"repeat {rep + 1}/{args.repeats}: "
              + ", ".join(f"{m} {times[m][-1]:.2f}s" for m in methods), flush=True)

    ref = outs["nanospec plain"]
    tokens = sum(len(o) for o in ref)
    print(f"\ntransformers {transformers.__version__}, torch {torch.__version__}, cpu, "
          f"{torch.get_num_threads()} threads, float32, greedy; {len(prompts)} prompts from "
          f"{args.prompts} x {n} new tokens; median of {args.repeats}")
    print(f"{'method':<36}{'tokens/s':>10}{'vs its own plain':>18}"
          f"{'same tokens as nanospec plain':>32}")
    for m in methods:
        own_plain = "transformers plain" if m.startswith("transformers") else "nanospec plain"
        speed = statistics.median(a / b for a, b in zip(times[own_plain], times[m]))
        same = sum(o == r for o, r in zip(outs[m], ref))
        tokens_per_s = tokens / statistics.median(times[m])
        print(f"{m:<36}{tokens_per_s:>10.0f}{speed:>17.2f}x{same:>24}/{len(ref)}")


if __name__ == "__main__":
    run(main, errors=(CheckpointError, ValueError, data.DataError))
