"""
training/forward_cost.py -- what a target's forward of T tokens costs next to one token on this
machine, and what that means for drafting.

Speculative decoding pays where a verify of k + 1 tokens costs little more than one decode step
and a draft costs little next to both. On a GPU that is the regime of every model the papers
measure; on a CPU it depends on the model's size. These functions time it: a forward at each size
after a cached context, and a block drafter's draft beside it, at the target's width and with
random weights (what a draft costs does not depend on them). docs/results.md holds the tables.

    python -m training.forward_cost SOURCE     # a model folder or GGUF, beside out/target.pt
"""

import os
import statistics
import sys
import time

import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import draft_dflash
import draft_dspark
from draft_dflash import DFlash, DFlashDrafter
from draft_dspark import DSpark, DSparkConfig, DSparkDrafter
from runtime import cpu_speed
from formats import gguf_int4
from runtime.checkpoint import CheckpointError, load_trained
from runtime.declaration import Declaration
from runtime.profiling import profile_dspark, profile_propose
from formats import pretrained
from llama import LlamaConfig
from runtime.command import run
from runtime.settings import (ArgumentParser, expand, number, number_list, preset_values,
                              read_settings)
from training.stages_dflash import DFlashSettings, network_config
from training.stages_dspark import DSparkSettings
from runtime.target import load_target


@torch.no_grad()
def forward_ms(model, context, sizes, repeats):
    """{T: median ms of one forward of T tokens after `context` cached positions}, batch 1; the
    sizes interleaved in every repeat, so drift in the machine's speed hits them alike."""
    cache = model.new_cache()
    V = model.config.vocab_size
    model(torch.randint(0, V, (1, context)), cache=cache)
    times = {T: [] for T in sizes}
    for _ in range(repeats + 1):  # the first round warms up (packed weights, allocator)
        for T in sizes:
            x = torch.randint(0, V, (1, T))
            t0 = time.perf_counter()
            model(x, cache=cache)
            times[T].append(1000 * (time.perf_counter() - t0))
            cache.rollback(context)
    return {T: statistics.median(ts[1:]) for T, ts in times.items()}


def block_drafters(target):
    """A DFlash and a DSpark network for target at the gpt2 preset's depth, block and rank (their
    stages' settings) with the target's width and heads, and random weights: what a draft costs
    does not depend on them."""
    gpt2 = ("gpt2", "cuda")
    dflash = read_settings(DFlashSettings, "", {**preset_values(DFlashSettings, "", gpt2),
                                                "heads": None})  # the target's
    rank = preset_values(DSparkSettings, "", gpt2)["rank"]
    cfg = network_config(dflash, target.config)
    torch.manual_seed(0)
    return {"dflash": cpu_speed.speed_up(DFlashDrafter(DFlash(cfg, target).eval())),
            "dspark": cpu_speed.speed_up(DSparkDrafter(DSpark(cfg, DSparkConfig(rank=rank),
                                                              target).eval(), schedule="full"))}


def report_cost(models, context, sizes, repeats):
    """Per target: ms of a forward at each size (and over one token's), then per block drafter
    ms of a whole block's draft and the break-even tau of a round that drafts it and verifies
    all of it: (verify + draft) / one step, the tokens a round must keep to pay. The forwards
    are timed once, together, and both lines read the same medians."""
    print(f"forward cost, batch 1, after {context} cached positions, float32 unless named, "
          f"{torch.get_num_threads()} threads, median of {repeats}:")
    for name, (m, drafters) in models.items():
        verifies = sorted({d.max_k + 1 for d in drafters.values()} - set(sizes))
        ms = forward_ms(m, context, [*sizes, *verifies], repeats)
        one = ms[1] if 1 in ms else forward_ms(m, context, [1], repeats)[1]
        cells = "  ".join(f"T={T}: {ms[T]:7.2f} ms ({ms[T] / one:.2f}x)" for T in sizes)
        print(f"  {name:<34}{cells}")
        for dname, d in drafters.items():
            k = d.max_k
            draft = 1000 * statistics.median(profile_propose(d, m, k, reps=5)
                                             for _ in range(repeats // 5 or 1))
            print(f"    {dname} draft of {k}: {draft:6.2f} ms ({draft / one:.2f} of a step); "
                  f"a round of it pays above tau = {(ms[k + 1] + draft) / one:.2f}")


def cost_models(model, toy_path, gguf_file=None):
    """{name: (target, {drafter name: drafter})}: the folder's target with block drafters of the
    gpt2 preset's shape (a GGUF's also in its own int4 codes, formats/gguf_int4.py), and the toy
    target with its trained ones where they exist."""
    cpu_speed.speed_up(model)
    models = {f"this folder ({model.num_params() / 1e6:.0f}M)": (model, block_drafters(model))}
    if gguf_file is not None and gguf_int4.int4_mm is not None:
        q = gguf_int4.quantized(model, gguf_file)[0]
        models["the same, int4 (its GGUF's codes)"] = (q, block_drafters(q))
    if os.path.exists(toy_path):
        try:
            toy, ckpt = load_target(toy_path)
        except CheckpointError as e:
            raise CheckpointError(f"--toy: {e}") from None
        out = os.path.dirname(os.path.abspath(toy_path))
        models[f"toy target ({toy.num_params() / 1e6:.1f}M)"] = (toy, trained(toy, ckpt, out))
    return models


def trained(toy, ckpt, out):
    """{name: drafter}: the toy target's trained DFlash and DSpark where out/ holds them, loaded
    as the registry loads them (the CPU's kernels; DSpark's scheduler profiled on this device)."""
    drafters = {}
    for declared in (Declaration(**draft_dflash.DRAFTER), Declaration(**draft_dspark.DRAFTER)):
        path = os.path.join(out, f"{declared.name}.pt")
        if os.path.exists(path):
            d = drafters[declared.name] = cpu_speed.speed_up(load_trained(declared, path, toy,
                                                                          ckpt))
            if isinstance(d, DSparkDrafter):
                profile_dspark(d)
    return drafters


# -----------------------------------------------------------------------------
# command line


def build_parser():
    p = ArgumentParser(prog="python -m training.forward_cost",
                       description="Time a pretrained model's forward of --sizes tokens, and a "
                       "block drafter's draft for it, beside the toy target's.")
    p.add_argument("source", help="a model folder, a .gguf file, or "
                   f"{', '.join(pretrained.WHEELS)} (an installed wheel's GGUF)")
    p.add_argument("--sizes", type=number_list(), default=[1, 8, 16],
                   help="tokens per timed forward, comma-separated (default: 1,8,16)")
    p.add_argument("--toy", type=expand, default="out/target.pt",
                   help="the toy target to time beside it, if it exists (default: out/target.pt)")
    p.add_argument("--context", type=number(int, lo=0), default=128,
                   help="cached positions before the timed forward (default: 128)")
    p.add_argument("--repeats", type=number(int, lo=1), default=30,
                   help="timed rounds (default: 30)")
    p.add_argument("--threads", type=number(int, lo=1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    return p


def main(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    src = pretrained.read(pretrained.resolve(a.source))
    cfg = src.config
    need = a.context + max(a.sizes)  # the cached context and the widest forward
    if need > cfg.sequence_len:
        p.error(f"argument --context: {a.context} cached positions and a forward of "
                f"{max(a.sizes)} tokens do not fit in {a.source}'s context window of "
                f"{cfg.sequence_len}")
    # a Llama's cache is as long as its context (tens of thousands of positions for Qwen3):
    # 64 more than the timing needs leaves room for a block drafter's verify
    model = pretrained.load(src, min(cfg.sequence_len, need + 64)
                            if isinstance(cfg, LlamaConfig) else None)
    print(f"{src.path}: {pretrained.describe(model, cfg)}")
    with torch.no_grad():
        report_cost(cost_models(model, a.toy, src.gguf_file), a.context, a.sizes, a.repeats)


if __name__ == "__main__":
    run(main, errors=(CheckpointError, ValueError))
