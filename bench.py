"""
bench.py -- proves equivalence and measures the speedup of every drafter.

speculative.py made the loop; this file runs it honestly. The baseline is plain decoding
with the same model, KV cache (the loop's one-row ragged.RaggedCache), dtype, device and
process; methods are interleaved prompt by prompt (A B C on prompt 1, then B C A, C B A, ...: a
seeded shuffle for each prompt) after a warm-up so drift hits all of them alike, and every figure
is a median over repeats of the same run. Absolute CPU times are noisy: read the ratios.

For each method it reports tau (tokens per target forward, bonus included), per-position
acceptance (the share of ALL rounds in which draft position i survived, so tau = 1 + its
sum), tokens/s, speedup over plain decoding, the draft/verify time split and the exact-match
rate against plain decoding (at any divergence: the target's logit margin there, because in
float32 a k-token verify can round a near-tie differently than a 1-token step). Then a sweep
over k (tokens drafted per round) shows how draft latency grows.

Two sizes. By default the headline: plain decoding and every trained drafter at its own k, on
fewer prompts, in about a minute on a CPU. With --full, what a researcher wants: more prompts and
repeats, every ablation row (dspark-full, dspark-nomarkov, mtp-k1, the hybrid's rules...), the
hybrid's oracle and the sweep over k. Both write the same JSON schema.

    python bench.py                          # the headline, for everything trained in out/:
                                             # the tables, out/bench.json, out/bench.png
    python bench.py --full                   # everything (docs/results.md: how long each takes)
    python bench.py --methods ar,small --k 4 --json out/small.json --plot out/small.png
    python bench.py --prompts humaneval              # the papers' code benchmark
    python bench.py --prompts humaneval-chat         # ... asked of a chat model, in its template
    python bench.py --prompts chat                   # prompts/chat.jsonl: 40 everyday questions
    python bench.py --prompts my_prompts.jsonl       # {"question": ...} or {"prompt": ...} a line
    python bench.py --json '' --plot ''              # print the tables only, write no file
    python -m benchmark.plot out/bench.json                    # redraw the figure from a saved run

JSON schema (OUT_DIR/bench.json, or --json PATH):
  {"device": str, "machine": str (the GPU's or CPU's model), "commit": str or null (git short
   hash, "+dirty" if tracked files had changes), "dtype": str, "threads": int,
   "one_row_matmul": "packed" or "torch" (runtime/cpu_speed.pick_one_row's pick), "torch": str,
   "arithmetic": str (what the target computed in: --arithmetic's pick, formats/gguf_int4.py),
   "k": int or null (null: each drafter's default), "sampling": str, "temperature": float,
   "full": bool (--full), "prompts": "validation", "humaneval", "humaneval-chat", "chat" or the
   JSONL file's path, "stop": [int] (the ids that end an answer: a chat model's end of turn),
   "n_prompts": int, "max_new_tokens": int, "repeats": int,
   "methods": {name: {"k": int, "tau": float, "speedup": float, "tokens_per_s": float,
                      "exact_match": float (share of prompts identical to plain decoding;
                                      null under rejection sampling),
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
                                 (hybrid only, greedy and coupled: see hybrid_oracle),
                      "nodes": int (trees only: most nodes a round), "oracle_tau": float
                                 (two-branch only, beside the hybrid's oracle)}},
   "sweep": {name: [{"k", "block_size", "draft_ms", "verify_ms", "tau", "speedup"}]} ({} unless
            --full or --sweep),
   "divergences": [{"method", "prompt", "position", "margin"}],
   "references": [{"method", "what", "paper", "source", "ours"}]  (the papers' figures, see
                                                                   REFERENCES),
   "verify_ms_by_tokens": {m: float} (with tree rows: a verify of m tokens, what trees pay),
   "peers": (--peers) {"rows": [{"engine", "method", "arithmetic", "tokens_per_s", "speedup"
            (over the engine's own plain decoding), "vs_llama_cpp" (over llama.cpp's plain
            decoding, null without it), "same" (prompts whose text is nanospec plain
            decoding's)}], "missing": {engine: why}, "versions", "n_prompts"}}
Method names: "ar" (plain decoding), then each registered drafter's name (registry/drafters.py),
and with --full the ablation variants a drafter offers (e.g. "dspark-nomarkov", "hybrid-m4"),
"mtp-k1" and the trees (tree.py): "dspark-tree", "dflash-tree", "two-branch" (greedy and coupled
only; one request at a time, so the serving sweep has none).
"""

import os
import random
import statistics
import time

import torch

from benchmark import ablations, papers, peers, prompt_sets, serving_sweep
from benchmark.flags import (MAX_NEW_TOKENS, build_parser, check_pairings, fit_new_tokens,
                             fit_sweep, sized)
from benchmark.report import Progress, check_outputs, commit, machine, print_report, write
from benchmark.serving_sweep import margin_at
from ragged import new_cache
from formats.chat import Chat
from registry import drafters as registry
from formats import gguf_int4, tokenizer
from runtime import command, cpu_speed
from runtime.checkpoint import CheckpointError
from runtime.devices import pick_device, synchronize
from runtime.profiling import add_stats, profile_verify, timed
from runtime.settings import parse_args
from sampler import Sampler
from speculative import Stats, generate_plain, generate_speculative, k_for
from training import data
from tree import TreeDrafter, generate_tree

TREE_WIDTHS = (1, 8, 16, 24, 32, 48, 64)  # verify widths whose cost --full prints beside the trees

# -----------------------------------------------------------------------------
# running one method over all prompts


class Caches:
    """The caches every method of a one-request run shares, made once (each is as long as the
    context window): a tree's gpt.KVCache, and the one-row ragged.RaggedCache of plain decoding
    and the loop."""

    def __init__(self, target):
        self.kv, self.ragged = target.new_cache(), new_cache(target, 1)


def run_ar(target, prompts, args, caches):
    """Plain decoding, with the Stats it implies: one target forward per token, nothing drafted
    (tau 1, no acceptance, no draft time), so every method is summarized alike."""
    outs = [generate_plain(target, p, args.max_new_tokens, make_sampler(args, target),
                           caches.ragged, stop=args.stop) for p in prompts]
    n = sum(len(o) for o in outs)
    return outs, Stats(tokens=n, target_forwards=n)


def run_spec(target, drafter, k, prompts, args, caches):
    # On a GPU the draft/verify split needs a wait between the two: one more sync a round, a
    # small handicap for the speculative methods, never in their favour. A CPU runs nothing
    # asynchronously.
    device = target.lm_head.weight.device
    sync = (lambda: synchronize(device)) if device.type != "cpu" else None
    total, outs = Stats(), []
    for p in prompts:
        if isinstance(drafter, TreeDrafter):  # its depth is its own max_k, its size its nodes
            out, stats = generate_tree(target, drafter, p, args.max_new_tokens,
                                       make_sampler(args, target), caches.kv, stop=args.stop)
        else:
            out, stats = generate_speculative(target, drafter, p, args.max_new_tokens, k,
                                              make_sampler(args, target), caches.ragged, sync=sync,
                                              stop=args.stop)
        outs.append(out)
        add_stats(total, stats)
    return outs, total


def make_sampler(args, target):
    device = target.lm_head.weight.device
    return Sampler(args.sampling, args.temperature, args.top_k, args.seed, device)


# -----------------------------------------------------------------------------
# main


def load(args, stem="bench"):
    """The flags -> (device, target, prompts, drafters), every check made before anything runs
    (the output files `stem`.json and .png, too); the target's checkpoint stays in args.target_ckpt
    (the peer table reads where it came from)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    Sampler(args.sampling, args.temperature, args.top_k)  # validate the sampling flags up front
    if args.prompts in (prompt_sets.HUMANEVAL, prompt_sets.HUMANEVAL_CHAT):
        prompt_sets.check_humaneval()  # before minutes of loading, not after
    wanted = args.methods or ["ar", *registry.names()]
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    # args.float_target: the peers' transformers rows read its weights
    target, target_ckpt, args.float_target, args.arithmetic_ran, args.one_row = \
        gguf_int4.decoding_target(os.path.join(args.out_dir, "target.pt"), args.arithmetic,
                                  device, dtype)
    args.target_ckpt = target_ckpt
    check_outputs(args, stem)
    # every data file checked, and the tokenizer the target was trained with
    enc = tokenizer.encoding_of(data.load_build_for(target_ckpt, args.out_dir))
    path = os.path.join(args.out_dir, "target.pt")
    prompts, args.stop = prompt_sets.prompts_for(
        args, args.out_dir, enc, target.config.sequence_len,
        lambda: Chat.of_target(target_ckpt, path, f"--prompts {args.prompts}"))
    fit_new_tokens(args, prompts, target.config.sequence_len)
    fit_sweep(args, prompts)
    return device, target, prompts, load_drafters(wanted, args, target, target_ckpt, device, dtype)


def load_drafters(wanted, args, target, target_ckpt, device, dtype):
    """{name: (drafter, k)}: every wanted drafter that is trained, and with --full its ablation
    variants and mtp at k = 1."""
    drafters = {}
    for name in wanted:
        if name == "ar":
            continue
        t0 = time.perf_counter()
        try:
            d = registry.load_drafter(name, args.out_dir, target, target_ckpt, device, dtype,
                                      args.sampling, args.hybrid_with)
        except CheckpointError as e:
            if args.methods:  # asked for by name: that's an error
                raise
            print(f"skipping {name}: {e}")
            continue
        print(f"loaded {name} in {time.perf_counter() - t0:.1f}s", flush=True)
        drafters[name] = (d, args.k or k_for(d, args.sampling))
        if args.full:
            for vname, vd in ablations.variants(d).items():
                drafters[vname] = (vd, args.k or k_for(vd, args.sampling))
    if args.full or args.trees:
        drafters.update(ablations.trees(drafters, args.sampling))
        if args.sampling == "rejection":  # --full's tree rows: named, not silently missing
            print("no token-tree rows: rejection sampling over a tree is not built")
    if args.full and "mtp" in drafters and args.k is None and drafters["mtp"][1] != 1:
        # second-token acceptance, as DeepSeek-V3 reports it, is k = 1
        drafters["mtp-k1"] = (drafters["mtp"][0], 1)
    return drafters


def run_method(name, target, drafters, prompts, args, caches):
    """(outputs, Stats) of one method ("ar" or a drafter's name) over `prompts`."""
    if name == "ar":
        return run_ar(target, prompts, args, caches)
    d, k = drafters[name]
    return run_spec(target, d, k, prompts, args, caches)


def warm_up(names, target, drafters, prompts, args, caches, device):
    """Each method once over the first two prompts (first calls allocate and pick kernels) ->
    {name: seconds per prompt}, the weights of the progress estimate."""
    warm = prompts[:2]
    return {name: timed(lambda: run_method(name, target, drafters, warm, args, caches),
                        device)[0] / len(warm) for name in names}


def run(target, prompts, drafters, args, device, caches, progress):
    """Every method over every prompt, `repeats` times -> (res, divergences, plain decoding's
    outputs). Interleaved prompt by prompt: each prompt runs under every method before the next
    one starts, so the drift of a shared machine (its speed moves over seconds) hits every
    method alike. The order is shuffled from prompt to prompt (seeded): in a fixed order a
    method always runs after the same one and finds that one's weights in the cache
    (docs/experiments.md: Bench: interleaving). So the methods finish together: the progress
    lines, four a pass, give each one's seconds so far."""
    names = ["ar", *drafters]
    times = {n: [] for n in names}
    outs = {n: [None] * len(prompts) for n in names}
    every = max(1, len(prompts) // 4)
    for rep in range(args.repeats):
        stats = {n: Stats() for n in names}  # the last repeat's are reported (tau repeats)
        for n in names:
            times[n].append(0.0)
        for i, p in enumerate(prompts):
            order = random.Random(rep * len(prompts) + i).sample(names, len(names))
            for name in order:
                t, (out, st) = timed(
                    lambda: run_method(name, target, drafters, [p], args, caches), device)
                times[name][-1] += t
                outs[name][i] = out[0]
                add_stats(stats[name], st)
            progress.did(names)
            if (i + 1) % every == 0 or i + 1 == len(prompts):
                progress.line(f"pass {rep + 1}/{args.repeats}, prompt {i + 1}/{len(prompts)}: "
                              + ", ".join(f"{n} {times[n][-1]:.1f}s" for n in names))
    return results(names, stats, times, outs, drafters, target, prompts,
                   checked=args.sampling != "rejection")


def results(names, stats, times, outs, drafters, target, prompts, checked=True):
    """The timed runs -> (res, divergences, plain decoding's outputs). checked: whether the
    outputs are plain decoding's token for token (greedy, coupled); under rejection sampling they
    are not meant to be (the distribution is: tests/test_speculative.py), and none is compared."""
    ref = outs["ar"]
    n_tokens = sum(len(o) for o in ref)
    res, divergences = {}, []
    for name in names:
        same = [o == r for o, r in zip(outs[name], ref)] if checked else None
        if checked:
            divergences += diverged(name, outs[name], ref, target, prompts)
        d, k = drafters.get(name, (None, 0))  # plain decoding drafts 0 tokens and trained nothing
        res[name] = summarize(stats[name], k, getattr(d, "budget", []), times[name], times["ar"],
                              n_tokens, same)
        if hasattr(d, "lookup_share"):  # a hybrid: how often it copied (over the whole run)
            res[name]["lookup_share"] = d.lookup_share
        if isinstance(d, TreeDrafter):  # a tree: its most nodes a round
            res[name]["nodes"] = d.nodes
    return res, divergences, ref


def hybrid_oracle(res, target, prompts, ref, drafters, args):
    """The hybrid's ceiling beside it (res["hybrid"]["oracle"]): each round the better of its two
    drafts, judged against plain decoding's own output (greedy and coupled: the output is fixed),
    so tau only; and the share of the gap from the best single drafter's tau to it that the rule
    closes."""
    hybrid, k = drafters["hybrid"]
    stats = ablations.oracle_stats(hybrid, target, prompts, ref, k,
                                   lambda: make_sampler(args, target), args.max_new_tokens,
                                   args.stop)
    singles = [res[n]["tau"] for n in (hybrid.lookup.name, hybrid.learned.name) if n in res]
    best = max(singles) if singles else 1.0
    gap = stats["tau"] - best
    stats["gap_closed"] = (res["hybrid"]["tau"] - best) / gap if gap > 0 else None
    res["hybrid"]["oracle"] = stats
    if "two-branch" in res:  # both drafts verified every round where both are drafted
        res["two-branch"]["oracle_tau"] = stats["tau"]


def summarize(stats, k, budget, times, ar_times, n_tokens, same):
    """One method's entry in the results (the JSON schema's "methods")."""
    med = statistics.median(times)
    rounds = max(1, stats.rounds)
    return {
        "k": k,
        "tau": stats.tau,
        "speedup": statistics.median(a / b for a, b in zip(ar_times, times)),
        "tokens_per_s": n_tokens / med,
        "exact_match": sum(same) / len(same) if same is not None else None,
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


def swept(drafters):
    """{name: drafter} of the sweep over k: ablations aside but the full block, and not the
    hybrid (its k is only a cap)."""
    return {n: d for n, (d, _) in drafters.items()
            if ("-" not in n or n.endswith("-full")) and n != "hybrid"}


def at_k(swept, k):
    """The swept drafters that can draft k tokens a round."""
    return [n for n, d in swept.items() if d.max_k is None or k <= d.max_k]


def sweep_k(target, prompts, drafters, args, device, caches, progress):
    """Draft and verify latency per round against k, for each drafter in swept(). One pass,
    interleaved like run(): at each k, prompt by prompt, plain decoding and every drafter that
    drafts that k run in a shuffled order, and each speedup is against plain decoding over those
    same prompts and seconds. Why: timed one drafter after another against plain decoding timed
    once at the start, the drift of a shared machine went into the ratios (docs/experiments.md:
    Bench: interleaving)."""
    sw = swept(drafters)
    if not args.sweep or not sw:
        return {}
    sp = prompts[:args.sweep_prompts]
    sweep = {n: [] for n in sw}
    for k in args.sweep:
        names = at_k(sw, k)
        secs, stats = dict.fromkeys(["ar", *names], 0.0), {n: Stats() for n in names}
        for i, p in enumerate(sp):
            for name in random.Random(k * len(sp) + i).sample(list(secs), len(secs)):
                t, (_, st) = timed(lambda: run_ar(target, [p], args, caches) if name == "ar"
                                   else run_spec(target, sw[name], k, [p], args, caches), device)
                secs[name] += t
                if name != "ar":
                    add_stats(stats[name], st)
            progress.did(secs)
        progress.line(f"sweep k={k}: " + ", ".join(f"{n} tau {stats[n].tau:.2f}" for n in names))
        for n in names:
            r = max(1, stats[n].rounds)
            sweep[n].append({"k": k, "block_size": k + 1,
                             "draft_ms": 1000 * stats[n].draft_time / r,
                             "verify_ms": 1000 * stats[n].verify_time / r, "tau": stats[n].tau,
                             "speedup": secs["ar"] / secs[n]})
    return {n: rows for n, rows in sweep.items() if rows}


def main(argv=None):
    args = parse_args(build_parser(), argv)  # warns about sampling flags the mode ignores
    check_pairings(args)
    args = sized(args)
    cpu_speed.enable()
    if args.batch_size is not None:
        args.max_new_tokens = args.max_new_tokens or serving_sweep.NEW_TOKENS
        return main_batched(args)
    args.max_new_tokens = args.max_new_tokens or MAX_NEW_TOKENS
    device, target, prompts, drafters = load(args)
    temperature = f" T={args.temperature}" if args.sampling != "greedy" else ""
    header = (f"device {device} | arithmetic {args.arithmetic_ran} | "
              f"{torch.get_num_threads()} threads | "
              f"one-row matmul {args.one_row} | "
              f"torch {torch.__version__} | {len(prompts)} {prompt_set(args)} prompts x "
              f"{'up to ' if args.stop else ''}{args.max_new_tokens} new tokens"
              f"{' (an answer ends at its end of turn)' if args.stop else ''} | "
              f"sampling {args.sampling}{temperature} | "
              f"{args.repeats} repeats" + (" | full" if args.full else ""))
    print(header)
    caches = Caches(target)
    progress = plan(warm_up(["ar", *drafters], target, drafters, prompts, args, caches, device),
                    drafters, prompts, args)
    res, divergences, ref = run(target, prompts, drafters, args, device, caches, progress)
    if oracle_runs(drafters, args):
        hybrid_oracle(res, target, prompts, ref, drafters, args)
        progress.did(["hybrid"], len(prompts))
        progress.line(f"hybrid oracle: tau {res['hybrid']['oracle']['tau']:.2f}")
    sweep = sweep_k(target, prompts, drafters, args, device, caches, progress)
    if args.peers:
        progress.line("the peer table: every engine over every prompt")
        peer_table = peers.table(target, args.float_target, args.target_ckpt, prompts, args,
                                 device, peer_methods(target, drafters, args, caches))
    out = {"device": device, "machine": machine(device), "commit": commit(), "dtype": args.dtype,
           "arithmetic": args.arithmetic_ran,
           "threads": torch.get_num_threads(), "one_row_matmul": args.one_row,
           "torch": torch.__version__, "k": args.k,
           "sampling": args.sampling, "temperature": args.temperature, "full": args.full,
           "prompts": prompt_set(args), "stop": sorted(args.stop), "n_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "methods": res, "sweep": sweep, "divergences": divergences,
           "references": papers.references(res, prompt_set(args)),
           "verify_ms_by_tokens": tree_costs(target, drafters),
           **({"peers": peer_table} if args.peers else {})}
    print_report(out, header)
    if args.peers:
        print("\n" + peers.report(peer_table))
    if out["verify_ms_by_tokens"]:
        print("what the trees pay, a verify of m tokens (ms, batch 1): " + ", ".join(
            f"{m}: {ms:.2f}" for m, ms in out["verify_ms_by_tokens"].items()))
    write(out, args)
    return out


def peer_methods(target, drafters, args, caches):
    """{row name: prompt -> ids} of every method of this run, for the peer table's nanospec rows."""
    def one(name):
        return lambda p: run_method(name, target, drafters, [p], args, caches)[0][0]
    rows = {"plain": one("ar")}
    for name, (d, k) in drafters.items():
        rows[f"prompt lookup ({k})" if name == "lookup" else f"{name} (k={k})"] = one(name)
    return rows


def tree_costs(target, drafters):
    """{m: ms of a target forward over m tokens} at the widths a tree may take, on this device:
    a tree's price, beside its rows ({} without tree rows)."""
    if not any(isinstance(d, TreeDrafter) for d, _ in drafters.values()):
        return {}
    m_max = min(max(TREE_WIDTHS), target.config.sequence_len // 2)
    t = profile_verify(target, m_max, reps=5)
    return {m: round(1000 * t[m], 3) for m in TREE_WIDTHS if m <= m_max}


def prompt_set(args):
    """The JSON's "prompts": "validation", a named set or the file's path."""
    return args.prompts or "validation"


def oracle_runs(drafters, args):
    """The hybrid's oracle runs with --full, where there is an output to judge by (rejection
    sampling has none)."""
    return args.full and "hybrid" in drafters and args.sampling != "rejection"


def plan(per_prompt, drafters, prompts, args):
    """A Progress with everything still to run planned: the passes, the oracle, the sweep."""
    progress = Progress(per_prompt)
    progress.plan(["ar", *drafters], len(prompts) * args.repeats)
    if oracle_runs(drafters, args):
        progress.plan(["hybrid"], len(prompts))
    sw = swept(drafters)
    for k in args.sweep if sw else []:
        progress.plan(["ar", *at_k(sw, k)], len(prompts[:args.sweep_prompts]))
    return progress


def main_batched(args):
    """--batch-size: the serving sweep (serving_sweep.py), its tables, OUT_DIR/serving.json and
    OUT_DIR/serving.png."""
    if not args.batch_size:
        raise ValueError("--batch-size needs at least one batch size, e.g. 1,4,16")
    device, target, prompts, drafters = load(args, "serving")
    if max(args.batch_size) > len(prompts):
        more = "raise --n-prompts" if not args.prompts else "give more prompts"
        raise ValueError(f"batch size {max(args.batch_size)} is more than the {len(prompts)} "
                         f"prompts: {more} or lower --batch-size")
    cut = "" if args.prompts else " (cut to different lengths)"
    print(f"device {device} | arithmetic {args.arithmetic_ran} | {torch.get_num_threads()} "
          f"threads | {len(prompts)} {prompt_set(args)} prompts{cut} x "
          f"{'up to ' if args.stop else ''}{args.max_new_tokens} new tokens | sampling {args.sampling} | batch sizes "
          f"{args.batch_size} | {args.repeats} repeats")
    serving = serving_sweep.sweep(target, prompts, drafters, args, device)
    out = {"device": device, "machine": machine(device), "commit": commit(), "dtype": args.dtype,
           "arithmetic": args.arithmetic_ran, "threads": torch.get_num_threads(),
           "torch": torch.__version__,
           "sampling": args.sampling, "temperature": args.temperature,
           "prompts": prompt_set(args), "stop": sorted(args.stop), "n_prompts": len(prompts),
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "serving": serving}
    print()
    print(serving_sweep.report(serving))
    write(out, args, "serving")
    return out


if __name__ == "__main__":
    command.run(main, errors=(CheckpointError, ValueError, data.DataError),
                interrupted="no results file is written before the run ends: run it again")
