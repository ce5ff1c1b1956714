"""
bench.py -- proves equivalence and measures the speedup of every drafter.

speculative.py made the loop; this file runs it honestly. The baseline is plain decoding
with the same model, KV cache, dtype, device and process; methods are interleaved prompt
by prompt (A B C on prompt 1, then B C A, C B A, ...: a seeded shuffle for each prompt)
after a warm-up so drift hits all of them alike, and every figure is a median over repeats
of the same run. Absolute CPU times are noisy: read the ratios.

For each method it reports tau (tokens per target forward, bonus included), per-position
acceptance (the share of ALL rounds in which draft position i survived, so tau = 1 + its
sum), tokens/s, speedup over plain decoding, the draft/verify time split and the exact-match
rate against plain decoding (at any divergence: the target's logit margin there, because in
float32 a k-token verify can round a near-tie differently than a 1-token step). Then a sweep
over k (tokens drafted per round) shows how draft latency grows.

    python bench.py                          # everything trained in out/: the tables, then
                                             # out/bench.json and the figure out/bench.png
    python bench.py --methods ar,small --k 4 --json out/small.json --plot out/small.png
    python bench.py --prompts my_prompts.jsonl       # {"prompt": "..."} per line
    python bench.py --json '' --plot ''              # print the tables only, write no file
    python plot.py out/bench.json                    # redraw the figure from a saved run

JSON schema (OUT_DIR/bench.json, or --json PATH):
  {"device": str, "machine": str (the GPU's or CPU's model), "commit": str or null (git short
   hash, "+dirty" if tracked files had changes), "dtype": str, "threads": int, "torch": str,
   "k": int or null (null: each drafter's default), "sampling": str, "temperature": float,
   "n_prompts": int, "max_new_tokens": int, "repeats": int,
   "methods": {name: {"k": int, "tau": float, "speedup": float, "tokens_per_s": float,
                      "exact_match": float (share of prompts identical to plain decoding),
                      "per_position_acceptance": [float] (position i's share of all rounds,
                                 i.e. target forwards, the prefill's included, in which it was
                                 drafted and survived; tau = 1 + its sum),
                      "mean_drafted": float,
                      "draft_ms_per_round": float, "verify_ms_per_round": float,
                      "draft_share": float, "seconds": float (median per pass),
                      "budget": [{"steps": int, "seconds": int}] (its training; a warm
                                 start's first),
                      "lookup_share": float (hybrids only: the share of rounds the lookup
                                 drafted), "oracle": {"tau", "lookup_share", "gap_closed"}
                                 (hybrid only, greedy and coupled: see hybrid_oracle)}},
   "sweep": {name: [{"k", "block_size", "draft_ms", "verify_ms", "tau", "speedup"}]},
   "divergences": [{"method", "prompt", "position", "margin"}],
   "references": [{"method", "what", "paper", "source", "ours"}]}  (the papers' figures, see
                                                                   REFERENCES)
Method names: "ar" (plain decoding), then "small", "mtp", "eagle", "dflash", "dspark", "lookup",
"hybrid" and any ablation variants a drafter offers (e.g. "dspark-nomarkov", "hybrid-m4").
"""

import argparse
import json
import os
import platform
import random
import statistics
import subprocess

import torch

import ablations
import papers
import bench_batched
import cpu_speed
import data
import plot
from bench_batched import margin_at
from checkpoint import DRAFTERS, HYBRID_WITH, CheckpointError, load_drafter, load_target
from devices import pick_device, synchronize
from profiling import add_stats, timed
from settings import (ArgumentParser, add_sampling_flags, number, number_list, parse_args,
                      path_arg)
from speculative import Sampler, Stats, generate_plain, generate_speculative, k_for

MAX_NEW_TOKENS = 128  # tokens per prompt in the one-request bench unless told

# -----------------------------------------------------------------------------
# prompts


def read_prompts(path, enc):
    """JSONL, one {"prompt": "..."} per line; blank lines are skipped."""
    if not os.path.exists(path):
        raise ValueError(f"--prompts file {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts file {path} is not UTF-8 text (byte {e.start}): "
                         "save it as UTF-8 JSONL") from None
    prompts = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise ValueError(f'{path} line {i} is not a JSON object like '
                             '{"prompt": "some text"}') from None
        prompts.append(data.encode(enc, text))
    if not prompts:
        raise ValueError(f"--prompts file {path} holds no prompts")
    return prompts


# -----------------------------------------------------------------------------
# running one method over all prompts


def run_ar(target, prompts, args, cache):
    """Plain decoding, with the Stats it implies: one target forward per token, nothing drafted
    (tau 1, no acceptance, no draft time), so every method is summarized alike."""
    outs = [generate_plain(target, p, args.max_new_tokens, make_sampler(args, target), cache)
            for p in prompts]
    n = sum(len(o) for o in outs)
    return outs, Stats(tokens=n, target_forwards=n)


def run_spec(target, drafter, k, prompts, args, cache):
    # On a GPU the draft/verify split needs a wait between the two: one more sync a round, a
    # small handicap for the speculative methods, never in their favour. A CPU runs nothing
    # asynchronously.
    device = target.lm_head.weight.device
    sync = (lambda: synchronize(device)) if device.type != "cpu" else None
    total, outs = Stats(), []
    for p in prompts:
        out, stats = generate_speculative(target, drafter, p, args.max_new_tokens, k,
                                          make_sampler(args, target), cache, sync=sync)
        outs.append(out)
        add_stats(total, stats)
    return outs, total


def make_sampler(args, target):
    device = target.lm_head.weight.device
    return Sampler(args.sampling, args.temperature, args.top_k, args.seed, device)


def machine(device):
    """The GPU's name on CUDA, else the CPU's model name where the OS says it, else the
    architecture."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown"


def commit():
    """The git short hash of this code (+dirty if tracked files changed), or None outside a git
    checkout."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()
    try:
        dirty = "+dirty" if git("status", "--porcelain", "-uno") else ""
        return git("rev-parse", "--short", "HEAD") + dirty
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or it hung
        return None


# -----------------------------------------------------------------------------
# reporting


def bar(x, scale, width=40):
    return "█" * max(1, round(width * x / scale)) if scale > 0 else ""


def report(res, sweep, header):
    lines = [header, ""]
    lines.append(f"{'method':<18}{'k':>3}{'drafted':>8}{'tau':>7}{'tok/s':>8}{'speedup':>9}"
                 f"{'draft/verify ms':>17}{'exact':>7}  acceptance by position (of all rounds)")
    for name, r in res.items():
        acc = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"][:8])
        dv = "-" if name == "ar" else (f"{r['draft_ms_per_round']:.2f}/"
                                       f"{r['verify_ms_per_round']:.2f}")
        lines.append(f"{name:<18}{r['k']:>3}{r['mean_drafted']:>8.2f}{r['tau']:>7.2f}"
                     f"{r['tokens_per_s']:>8.0f}{r['speedup']:>8.2f}x{dv:>17}"
                     f"{r['exact_match']:>7.0%}  {acc}")
    if "oracle" in res.get("hybrid", {}):
        o, closed = res["hybrid"]["oracle"], res["hybrid"]["oracle"]["gap_closed"]
        lines += ["", f"hybrid: the lookup drafted {res['hybrid']['lookup_share']:.0%} of its "
                  f"rounds. Its oracle (the better of both drafts each round, judged by plain "
                  f"decoding's output; tau only): tau {o['tau']:.2f}, the lookup's draft in "
                  f"{o['lookup_share']:.0%} of rounds"
                  + (f"; the rule closes {closed:.0%} of the gap from the best single drafter's "
                     "tau" if closed is not None else "")]
    top = max(r["speedup"] for r in res.values())
    lines += ["", "speedup over plain decoding (median of repeats, same run)"]
    lines += [f"  {name:<18}{bar(r['speedup'], top)} {r['speedup']:.2f}x"
              for name, r in res.items()]
    lines += ["", "training budget (optimizer steps and seconds of its train.py stage; "
                  "a warm start's first)"]
    lines += [f"  {name:<18}{budget_text(r['budget'])}" for name, r in res.items() if r["budget"]]
    if sweep:
        lines += ["", "draft latency per round against k (tokens drafted per round)"]
        lines.append(f"  {'method':<10}{'k':>4}{'draft ms':>10}{'verify ms':>11}{'tau':>7}"
                     f"{'speedup':>9}")
        top = max(s["draft_ms"] for rows in sweep.values() for s in rows)
        for name, rows in sweep.items():
            for s in rows:
                lines.append(f"  {name:<10}{s['k']:>4}{s['draft_ms']:>10.2f}{s['verify_ms']:>11.2f}"
                             f"{s['tau']:>7.2f}{s['speedup']:>8.2f}x  "
                             f"{bar(s['draft_ms'], top, 30)}")
    return "\n".join(lines)


def budget_text(budget):
    """[{steps, seconds}, ...] -> '3000 + 400 steps, 480 + 75 s' (a warm start's budget first)."""
    if not budget:
        return "–"
    return (" + ".join(str(b["steps"]) for b in budget) + " steps, " +
            " + ".join(str(b["seconds"]) for b in budget) + " s")


def markdown(res):
    rows = ["| method | k | drafted / round | τ | tokens/s | speedup "
            "| draft / verify ms per round | exact match | trained |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in res.items():
        dv = "–" if name == "ar" else (f"{r['draft_ms_per_round']:.2f} / "
                                       f"{r['verify_ms_per_round']:.2f}")
        rows.append(f"| {name} | {r['k']} | {r['mean_drafted']:.2f} | {r['tau']:.2f} "
                    f"| {r['tokens_per_s']:.0f} | {r['speedup']:.2f}× | {dv} "
                    f"| {r['exact_match']:.0%} | {budget_text(r['budget'])} |")
    return "\n".join(rows)


# -----------------------------------------------------------------------------
# main


def plot_path(text):
    """--plot: '' (no figure) or an image file to write, checked before the run, not after it."""
    if text and os.path.splitext(text)[1].lower() not in (".png", ".svg", ".pdf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .png, .svg or .pdf file name")
    return text and path_arg("out")(text)


def json_path(text):
    """--json: '' (no JSON) or a file to write, checked before the run."""
    return text and path_arg("out")(text)


def build_parser():
    """The flags in four groups, so that --help reads as what to run, how to sample, how to
    measure and what to write; each help says its default."""
    p = ArgumentParser(description="Benchmark plain decoding against every drafter (the trained "
                                   "ones and prompt lookup).")
    add_run_flags(p.add_argument_group("what to run"))
    add_sampling_flags(p.add_argument_group("sampling"))  # the same four as sample.py's
    add_measurement_flags(p.add_argument_group("measurement"))
    add_output_flags(p.add_argument_group("output"))
    return p


def add_run_flags(g):
    g.add_argument("--methods", default=None,
                   help=f"comma list from ar,{','.join(DRAFTERS)} (default: every trained one)")
    g.add_argument("--k", type=number(int, 1), default=None,
                   help="tokens drafted per round (default: each drafter's own)")
    g.add_argument("--hybrid-with", default=HYBRID_WITH,
                   help="the learned drafter the hybrid pairs with prompt lookup "
                   "(default: %(default)s)")
    g.add_argument("--prompts", type=path_arg("in"), default=None,
                   help='JSONL file of {"prompt": "..."} lines (default: validation prompts)')
    g.add_argument("--n-prompts", type=number(int, 1), default=32,
                   help="how many validation prompts (default: %(default)s)")
    g.add_argument("--prompt-len", type=number(int, 1), default=None,
                   help="tokens per validation prompt "
                   "(default: 64, or a quarter of a smaller context)")
    g.add_argument("--max-new-tokens", type=number(int, 1), default=None,
                   help="tokens generated per prompt (default: 128; with --batch-size "
                   f"{bench_batched.NEW_TOKENS})")
    g.add_argument("--batch-size", type=number_list(int, 1), default=None,
                   help="the serving sweep instead: comma list of batch sizes, each method "
                   "batched against batched plain decoding, e.g. 1,2,4,8,16,32; at most "
                   "--n-prompts (bench_batched.py; default: none, one request at a time)")


def add_measurement_flags(g):
    g.add_argument("--repeats", type=number(int, 1), default=3,
                   help="timed passes over all prompts per method, reported as their median "
                   "(default: %(default)s)")
    g.add_argument("--sweep", type=number_list(int, 1), default="1,2,3,4,5,7,10,15",
                   help="k values for the draft-latency sweep, '' to skip (default: %(default)s)")
    g.add_argument("--sweep-prompts", type=number(int, 1), default=8,
                   help="prompts used by the sweep (default: the first %(default)s)")
    g.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch CPU threads (default: torch's choice)")
    g.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16"],
                   help="model dtype (default: %(default)s)")
    g.add_argument("--device", default="auto",
                   help="auto, cpu, cuda or mps (default: auto: cuda, else mps, else cpu)")


def add_output_flags(g):
    g.add_argument("--out-dir", type=path_arg("dir"), default="out",
                   help="where train.py put the checkpoints, and where the JSON and the figure "
                   "go by default (default: %(default)s)")
    g.add_argument("--json", type=json_path, default=None,
                   help="write the results as JSON here, schema in the docstring "
                   "(default: OUT_DIR/bench.json; '' to skip)")
    g.add_argument("--markdown", type=path_arg("out"), default=None,
                   help="write a markdown results table here (default: none)")
    g.add_argument("--plot", type=plot_path, default=None,
                   help="draw the figure to this image file, e.g. a .png "
                   "(default: OUT_DIR/bench.png; '' to skip; needs matplotlib)")


def load(args):
    """The flags -> (device, target, prompts, drafters), every check made before anything runs."""
    if args.threads:
        torch.set_num_threads(args.threads)
    Sampler(args.sampling, args.temperature, args.top_k)  # validate the sampling flags up front
    wanted = args.methods.split(",") if args.methods else ["ar", *DRAFTERS]
    for m in wanted:
        if m != "ar" and m not in DRAFTERS:
            raise ValueError(f"unknown method {m!r}: choose from ar, {', '.join(DRAFTERS)}")
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    target, target_ckpt = load_target(os.path.join(args.out_dir, "target.pt"), device, dtype)
    enc = data.encoding_of(data.load_build(args.out_dir))  # every data file checked
    if args.prompts:
        prompts = read_prompts(args.prompts, enc)
    else:
        prompt_len = args.prompt_len or min(64, target.config.block_size // 4)
        prompts = data.val_prompts(args.out_dir, args.n_prompts, prompt_len)
    for i, p in enumerate(prompts):
        if len(p) >= target.config.block_size:
            raise ValueError(f"prompt {i + 1} has {len(p)} tokens but the context window is "
                             f"{target.config.block_size}")
    return device, target, prompts, load_drafters(wanted, args, target, target_ckpt, device, dtype)


def load_drafters(wanted, args, target, target_ckpt, device, dtype):
    """{name: (drafter, k)}: every wanted drafter that is trained, its ablation variants, and mtp
    at k = 1."""
    drafters = {}
    for name in wanted:
        if name == "ar":
            continue
        try:
            d = load_drafter(name, args.out_dir, target, target_ckpt, device, dtype, args.sampling,
                             args.hybrid_with)
        except CheckpointError as e:
            if args.methods:  # asked for by name: that's an error
                raise
            print(f"skipping {name}: {e}")
            continue
        drafters[name] = (d, args.k or k_for(d, args.sampling))
        for vname, vd in ablations.variants(d).items():
            drafters[vname] = (vd, args.k or k_for(vd, args.sampling))
    if "mtp" in drafters and args.k is None and drafters["mtp"][1] != 1:
        # second-token acceptance, as DeepSeek-V3 reports it, is k = 1
        drafters["mtp-k1"] = (drafters["mtp"][0], 1)
    return drafters


def run_method(name, target, drafters, prompts, args, cache):
    """(outputs, Stats) of one method ("ar" or a drafter's name) over `prompts`."""
    if name == "ar":
        return run_ar(target, prompts, args, cache)
    d, k = drafters[name]
    return run_spec(target, d, k, prompts, args, cache)


def run(target, prompts, drafters, args, device, cache):
    """Every method over every prompt, `repeats` times -> (res, divergences). Interleaved prompt
    by prompt: each prompt runs under every method before the next one starts, so the drift of
    a shared machine (its speed moves over seconds) hits every method alike. The order is
    shuffled from prompt to prompt (seeded): in a fixed order a method always runs after the
    same one and finds that one's weights in the cache (docs/experiments.md: Bench:
    interleaving)."""
    names = ["ar", *drafters]
    for name in names:  # warm-up: first calls allocate and pick kernels
        run_method(name, target, drafters, prompts[:2], args, cache)
    times = {n: [] for n in names}
    outs = {n: [None] * len(prompts) for n in names}
    for rep in range(args.repeats):
        stats = {n: Stats() for n in names}  # the last repeat's are reported (tau repeats)
        for n in names:
            times[n].append(0.0)
        for i, p in enumerate(prompts):
            order = random.Random(rep * len(prompts) + i).sample(names, len(names))
            for name in order:
                t, (out, st) = timed(
                    lambda: run_method(name, target, drafters, [p], args, cache), device)
                times[name][-1] += t
                outs[name][i] = out[0]
                add_stats(stats[name], st)
        print(f"repeat {rep + 1}/{args.repeats}: "
              + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)

    ref = outs["ar"]
    n_tokens = sum(len(o) for o in ref)
    res, divergences = {}, []
    for name in names:
        same = [o == r for o, r in zip(outs[name], ref)]
        divergences += diverged(name, outs[name], ref, target, prompts)
        d, k = drafters.get(name, (None, 0))  # plain decoding drafts 0 tokens and trained nothing
        res[name] = summarize(stats[name], k, getattr(d, "budget", []), times[name], times["ar"],
                              n_tokens, same)
        if hasattr(d, "lookup_share"):  # a hybrid: how often it copied (over the whole run)
            res[name]["lookup_share"] = d.lookup_share
    return res, divergences, ref


def hybrid_oracle(res, target, prompts, ref, drafters, args):
    """The hybrid's ceiling beside it (res["hybrid"]["oracle"]): each round the better of its two
    drafts, judged against plain decoding's own output (greedy and coupled: the output is fixed),
    so tau only; and the share of the gap from the best single drafter's tau to it that the rule
    closes."""
    hybrid, k = drafters["hybrid"]
    stats = ablations.oracle_stats(hybrid, target, prompts, ref, k,
                         lambda: make_sampler(args, target), args.max_new_tokens)
    singles = [res[n]["tau"] for n in ("lookup", args.hybrid_with) if n in res]
    best = max(singles) if singles else 1.0
    gap = stats["tau"] - best
    stats["gap_closed"] = (res["hybrid"]["tau"] - best) / gap if gap > 0 else None
    res["hybrid"]["oracle"] = stats


def summarize(stats, k, budget, times, ar_times, n_tokens, same):
    """One method's entry in the results (the JSON schema's "methods")."""
    med = statistics.median(times)
    rounds = max(1, stats.rounds)
    return {
        "k": k,
        "tau": stats.tau,
        "speedup": statistics.median(a / b for a, b in zip(ar_times, times)),
        "tokens_per_s": n_tokens / med,
        "exact_match": sum(same) / len(same),
        "per_position_acceptance": stats.acceptance(),
        "mean_drafted": sum(stats.drafted_at) / rounds,
        "draft_ms_per_round": 1000 * stats.draft_time / rounds,
        "verify_ms_per_round": 1000 * stats.verify_time / rounds,
        "draft_share": stats.draft_time / max(1e-9, stats.draft_time + stats.verify_time),
        "seconds": med,
        "budget": budget,
    }


def diverged(name, outs, ref, target, prompts):
    """Where a method's outputs first left plain decoding's, prompt by prompt, and the target's
    margin there."""
    rows = []
    for i, (o, r) in enumerate(zip(outs, ref)):
        if o != r:
            j = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
            rows.append({"method": name, "prompt": i, "position": j,
                         "margin": margin_at(target, prompts[i], r, j)})
    return rows


def sweep_k(target, prompts, drafters, args, device, cache):
    """Draft and verify latency per round against k, for each drafter (ablations aside but the
    full block). One pass, interleaved like run(): at each k, prompt by prompt, plain decoding
    and every drafter that drafts that k run in a shuffled order, and each speedup is against
    plain decoding over those same prompts and seconds. Why: timed one drafter after another
    against plain decoding timed once at the start, the drift of a shared machine went into
    the ratios (docs/experiments.md: Bench: interleaving)."""
    swept = {n: d for n, (d, _) in drafters.items()
             if ("-" not in n or n.endswith("-full")) and n != "hybrid"}  # its k is only a cap
    if not args.sweep or not swept:
        return {}
    sp = prompts[:args.sweep_prompts]
    sweep = {n: [] for n in swept}
    for k in args.sweep:
        names = [n for n, d in swept.items() if d.max_k is None or k <= d.max_k]
        secs, stats = dict.fromkeys(["ar", *names], 0.0), {n: Stats() for n in names}
        for i, p in enumerate(sp):
            for name in random.Random(k * len(sp) + i).sample(list(secs), len(secs)):
                t, (_, st) = timed(lambda: run_ar(target, [p], args, cache) if name == "ar"
                                   else run_spec(target, swept[name], k, [p], args, cache), device)
                secs[name] += t
                if name != "ar":
                    add_stats(stats[name], st)
        for n in names:
            r = max(1, stats[n].rounds)
            sweep[n].append({"k": k, "block_size": k + 1,
                             "draft_ms": 1000 * stats[n].draft_time / r,
                             "verify_ms": 1000 * stats[n].verify_time / r, "tau": stats[n].tau,
                             "speedup": secs["ar"] / secs[n]})
    return {n: rows for n, rows in sweep.items() if rows}


def print_report(out, header):
    """Everything printed after the timed runs: the tables, the papers' figures, any divergences."""
    print()
    print(report(out["methods"], out["sweep"], header))
    if out["references"]:
        print(f"\nthe papers' figures beside ours (theirs: GPU and multi-billion-parameter "
              f"targets; ours: {out['device']}, {out['dtype']})")
        for r in out["references"]:
            print(f"  {r['method']:<8}{r['what']:<22} paper {r['paper']:<18} ours {r['ours']:<14} "
                  f"[{r['source']}]")
    if out["divergences"]:
        print("\ndivergences from plain decoding (first differing token; small margins are float "
              "near-ties):")
        for dv in out["divergences"]:
            print(f"  {dv['method']}: prompt {dv['prompt']} at token {dv['position']}, "
                  f"target logit margin {dv['margin']:.2e}")
    print("\n" + markdown(out["methods"]))


def write(out, args):
    """The files: the JSON and the figure, by default beside the checkpoints (OUT_DIR/bench.json
    and OUT_DIR/bench.png, so that `python plot.py out/bench.json` redraws the figure; '' skips
    either), and the markdown table when asked for."""
    path = os.path.join(args.out_dir, "bench.json") if args.json is None else args.json
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results: {path}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(out["methods"]) + "\n")
    path = os.path.join(args.out_dir, "bench.png") if args.plot is None else args.plot
    if path:
        plot.save(out, path)  # without matplotlib: one line saying how to get it, no crash


def main(argv=None):
    args = parse_args(build_parser(), argv)  # warns about sampling flags the mode ignores
    cpu_speed.enable()
    if args.batch_size is not None:
        args.max_new_tokens = args.max_new_tokens or bench_batched.NEW_TOKENS
        return main_batched(args)
    args.max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
    device, target, prompts, drafters = load(args)
    temperature = f" T={args.temperature}" if args.sampling != "greedy" else ""
    header = (f"device {device} | dtype {args.dtype} | {torch.get_num_threads()} threads | "
              f"torch {torch.__version__} | {len(prompts)} prompts x {args.max_new_tokens} "
              f"new tokens | sampling {args.sampling}{temperature} | {args.repeats} repeats")
    print(header)
    cache = target.new_cache()
    res, divergences, ref = run(target, prompts, drafters, args, device, cache)
    if "hybrid" in drafters and args.sampling != "rejection":  # rejection: no output to judge by
        hybrid_oracle(res, target, prompts, ref, drafters, args)
    sweep = sweep_k(target, prompts, drafters, args, device, cache)
    out = {"device": device, "machine": machine(device), "commit": commit(), "dtype": args.dtype,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "k": args.k,
           "sampling": args.sampling, "temperature": args.temperature, "n_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "methods": res, "sweep": sweep, "divergences": divergences,
           "references": papers.references(res)}
    print_report(out, header)
    write(out, args)
    return out


def main_batched(args):
    """--batch-size: the serving sweep (bench_batched.py), its tables, OUT_DIR/serving.json and
    OUT_DIR/serving.png."""
    if not args.batch_size:
        raise ValueError("--batch-size needs at least one batch size, e.g. 1,4,16")
    device, target, prompts, drafters = load(args)
    if max(args.batch_size) > len(prompts):
        raise ValueError(f"batch size {max(args.batch_size)} is more than the {len(prompts)} "
                         "prompts: raise --n-prompts or lower --batch-size")
    print(f"device {device} | dtype {args.dtype} | {torch.get_num_threads()} threads | "
          f"{len(prompts)} prompts (cut to different lengths) x {args.max_new_tokens} new tokens |"
          f" sampling {args.sampling} | batch sizes {args.batch_size} | {args.repeats} repeats")
    serving = bench_batched.sweep(target, prompts, drafters, args, device)
    out = {"device": device, "machine": machine(device), "commit": commit(), "dtype": args.dtype,
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "sampling": args.sampling, "temperature": args.temperature, "n_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "serving": serving}
    print()
    print(bench_batched.report(serving))
    path = os.path.join(args.out_dir, "serving.json") if args.json is None else args.json
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
        print(f"results: {path}")
    path = os.path.join(args.out_dir, "serving.png") if args.plot is None else args.plot
    if path:
        plot.save(out, path)
    return out


if __name__ == "__main__":
    try:
        main()
    except (CheckpointError, ValueError, data.DataError) as e:
        raise SystemExit(f"error: {e}")
