"""
benchmark/serving_sweep.py -- the serving sweep: every method over batches of 1, 2, 4, ... requests.

bench.py measured one request at a time; this file adds what a serving user asks: how much does
speculation give when many requests share each target forward? For every batch size B it splits the
same prompts (of different lengths) into batches of B, decodes each batch with batched plain
decoding and with every method (speculative.generate_batch, through serving/batched.serve), interleaved batch by batch in a shuffled order,
and reports total and per-request tokens/s, the speedup over batched plain decoding AT THE SAME B,
tau, the verify tokens a round spent per request, the padding the attention ran, what each request
was given (its draft lengths), and whether every row is token-identical: to batched plain decoding
of the same batch, and to batch-1 plain decoding (float32 rounds a near-tie differently at another
matmul shape: the target's logit margin is printed at each such divergence).

Methods: "ar" (batched plain decoding), each drafter at its own k, and DSpark under each rule:
"dspark" (the measured rule: one width a round, or a plain batch, by measured tokens per second),
"dspark-cut" (its own scheduler, the paper's Algorithm 1, on a drafted block), "dspark-full" (its
whole block), "dspark-kN" (a fixed k of N).

    python bench.py --batch-size 1,2,4,8,16,32     # the sweep, then OUT_DIR/serving.json/.png
"""

import random
import statistics

import torch

from benchmark.ablations import batch_variants
from benchmark.report import Progress
from registry.drafters import batched
from serving.batched import serve
from runtime.profiling import timed
from ragged import new_cache
from sampler import Sampler
from speculative import generate_plain, generate_plain_batch

FIXED_K = (1, 2, 4, 8)  # DSpark's fixed-k rows: the baselines its scheduler must beat
NEW_TOKENS = 48  # tokens per request unless --max-new-tokens says otherwise: the sweep in minutes
MAX_BATCHES = 6  # batches timed per batch size: small batch sizes decode the first B * 6 prompts


def ragged(prompts, seed=0):
    """Prompts of different lengths from equal ones: each cut to a length between a quarter and
    all of it (seeded), as requests arriving at a server are."""
    rng = random.Random(seed)
    return [p[:rng.randint(max(1, len(p) // 4), len(p))] for p in prompts]


def methods(drafters):
    """{name: (batched drafter or None for plain, k)}: each drafter (under its serving rule) at
    its own k, and DSpark under every rule and at every fixed k."""
    out = {"ar": (None, 0)}
    for name, (d, k) in drafters.items():
        if "-" in name:  # batch-1 ablations: the serving rows below replace them
            continue
        if name != "dspark":
            try:
                out[name] = (batched(d), k)
            except NotImplementedError as e:  # a drafter with no batched form (the hybrid)
                print(f"skipping {name} in the serving sweep: {e}")
            continue
        full = d.max_k
        # its default rule is the one that pays in this sweep (docs/results.md: Many requests at
        # once); the other rules share its profiles: one cost table per batch size for all
        out["dspark"] = (batched(d), full)
        out.update({v: (vd, full) for v, vd in batch_variants(d).items()})
        for kk in FIXED_K:
            if kk < full:
                out[f"dspark-k{kk}"] = (out["dspark-full"][0], kk)
    return out


def run_batch(name, entry, target, batch, args, cache):
    """One method over one batch -> (token lists, Stats or None); a row ends at a stop token
    (a chat model's end of turn) or after args.max_new_tokens."""
    drafter, k = entry
    sampler = Sampler(args.sampling, args.temperature, args.top_k, args.seed,
                      target.lm_head.weight.device)
    if drafter is None:
        return generate_plain_batch(target, batch, args.max_new_tokens, sampler, cache,
                                    stop=args.stop), None
    return serve(target, drafter, batch, args.max_new_tokens, k, sampler, cache, stop=args.stop)


def at_batch_size(B, target, prompts, table, args, device):
    """Every method over the prompts in batches of B, `repeats` times, interleaved -> results."""
    batches = [prompts[i:i + B] for i in range(0, len(prompts) - B + 1, B)][:MAX_BATCHES]
    cache = new_cache(target, B)
    names = list(table)
    for name in names:  # warm-up; DSpark profiles its cost table for this batch size here
        run_batch(name, table[name], target, batches[0], args, cache)
    times = {n: [] for n in names}
    outs = {n: [None] * len(batches) for n in names}
    stats = {n: [None] * len(batches) for n in names}
    for rep in range(args.repeats):
        for n in names:
            times[n].append(0.0)
        for i, batch in enumerate(batches):
            order = random.Random(1000 * B + rep * len(batches) + i).sample(names, len(names))
            for name in order:
                t, (out, st) = timed(lambda: run_batch(name, table[name], target, batch, args, cache),
                                     device)
                times[name][-1] += t
                outs[name][i], stats[name][i] = out, st
    return times, outs, stats, batches


def summarize(times, ar_times, outs, ref, stats, n_tokens, B, checked=True):
    """One (batch size, method) entry of the results; checked: whether outputs are compared
    (not under rejection sampling, which keeps the distribution, not the tokens)."""
    med = statistics.median(times)
    rows = [o for batch in outs for o in batch]
    same = sum(o == r for o, r in zip(rows, [r for b in ref for r in b])) if checked else None
    entry = {"tokens_per_s": n_tokens / med, "per_request_tokens_per_s": n_tokens / med / B,
             "speedup": statistics.median(a / b for a, b in zip(ar_times, times)),
             "exact_match": same / len(rows) if checked else None, "seconds": med}
    st = [s for s in stats if s is not None]
    if st:
        forwards = sum(s.target_forwards for s in st)
        rounds = sum(s.rounds for s in st)
        verify = sum(s.verify_tokens for s in st)
        slots = sum(s.slots for s in st)
        given = [sum(s.given[i] for s in st) for i in range(len(st[0].given))]
        entry.update({"tau": sum(s.tokens for s in st) / forwards,
                      "verify_tokens_per_request_round": verify / max(1, rounds),
                      "verify_tokens_per_round": verify / max(1, sum(s.batches for s in st)),
                      "padding": 1 - verify / max(1, slots),
                      "given": [g / max(1, rounds) for g in given]})
    else:
        entry.update({"tau": 1.0, "verify_tokens_per_request_round": 1.0,
                      "verify_tokens_per_round": float(B), "padding": 0.0, "given": [1.0]})
    return entry


def margin_at(target, prompt, ref, j):
    """The target's top-1 minus top-2 logit where a method first left plain decoding."""
    with torch.inference_mode():
        x = torch.tensor([prompt + ref[:j]], device=target.lm_head.weight.device)
        top = target(x, last_only=True)[0][0, -1].float().topk(2).values
    return (top[0] - top[1]).item()


# -----------------------------------------------------------------------------
# the machine and code a run measured (recorded in the JSON, shown in the figure's title)


def against_batch_one(name, outs, batches, single, target):
    """Rows of `outs` that differ from batch-1 plain decoding -> divergences with the margin."""
    rows, prompts = [o for b in outs for o in b], [p for b in batches for p in b]
    found = []
    for i, (o, r) in enumerate(zip(rows, single[:len(rows)])):
        if o != r:
            j = next((j for j, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
            found.append({"method": name, "prompt": i, "position": j,
                          "margin": margin_at(target, prompts[i], r, j)})
    return found


def sweep(target, prompts, drafters, args, device):
    """The whole sweep -> {"batch_sizes", "results": {B: {method: entry}}, "divergences",
    "batch_one_match": {B: {method: share of rows equal to batch-1 plain decoding}}}. Validation
    prompts, all of one length, are cut to different lengths first; the others differ already."""
    prompts = prompts if args.prompts else ragged(prompts)
    table = methods(drafters)
    single = [generate_plain(target, p, args.max_new_tokens,
                             Sampler(args.sampling, args.temperature, args.top_k, args.seed,
                                     device), stop=args.stop) for p in prompts]
    results, divergences, match = {}, [], {}
    checked = args.sampling != "rejection"
    progress = Progress({"row": 1.0})  # rows decoded: a rough weight (a row costs less in a batch)
    for B in args.batch_size:
        progress.plan(["row"], B * min(MAX_BATCHES, len(prompts) // B))
    for B in args.batch_size:
        times, outs, stats, batches = at_batch_size(B, target, prompts, table, args, device)
        progress.did(["row"], sum(len(b) for b in batches))
        n_tokens = sum(len(o) for b in outs["ar"] for o in b)
        results[B], match[B] = {}, {}
        for name in table:
            results[B][name] = summarize(times[name], times["ar"], outs[name], outs["ar"],
                                         stats[name], n_tokens, B, checked)
            found = against_batch_one(name, outs[name], batches, single, target) if checked else []
            match[B][name] = 1 - len(found) / sum(len(b) for b in batches) if checked else None
            divergences += [dict(d, batch_size=B) for d in found]
        progress.line(f"batch {B}: " + ", ".join(f"{n} {results[B][n]['speedup']:.2f}x"
                                                 for n in table))
    spark = table.get("dspark", (None,))[0]
    profiles = getattr(spark, "profiles", {})
    return {"batch_sizes": list(args.batch_size), "results": results,
            "divergences": divergences, "batch_one_match": match,
            "k": {n: k for n, (_, k) in table.items()},
            # DSpark's start-up profile: seconds of a target forward over B rows of m = 1, 2, ...
            # tokens each, and of a draft of B rows at a few widths
            "cost_tables": {B: {"verify_ms": [1000 * x for x in c.seconds],
                                "draft_ms": {str(n): 1000 * float(d(n)) for n in
                                             (B * 2, B * 3, B * 5, B * 9, B * 16)}}
                            for B, (c, d) in profiles.items()},
            # what its measured rule timed: ms a round at each width it ran (0: a plain step)
            "measured_ms": {B: {str(w): 1000 * s for w, s in sorted(at.items())}
                            for B, at in getattr(getattr(spark, "widths", None), "seconds",
                                                 {}).items()}}


def report(serving):
    """The sweep's tables: speedup and tokens/s per method and batch size, then what a round
    spent and what each request was given."""
    Bs, res = serving["batch_sizes"], serving["results"]
    names = list(res[Bs[0]])
    head = "method          k " + "".join(f"{'B=' + str(B):>9}" for B in Bs)
    lines = ["speedup over batched plain decoding at the same batch size", head]
    for n in names:
        lines.append(f"{n:<15}{serving['k'][n]:>3} " + "".join(
            f"{res[B][n]['speedup']:>8.2f}x" for B in Bs))
    lines += ["", "tokens/s in all (per request)", head]
    for n in names:
        lines.append(f"{n:<15}{serving['k'][n]:>3} " + "".join(
            f"{res[B][n]['tokens_per_s']:>9.0f}" for B in Bs))
    lines += ["", "tau / verify tokens per request a round / padding share / exact (batched, "
              "batch-1)"]
    for B in Bs:
        lines.append(f"batch {B}:")
        for n in names:
            e = res[B][n]
            top = max(range(len(e["given"])), key=lambda i: e["given"][i])
            lines.append(f"  {n:<15} tau {e['tau']:5.2f}  verify {e['verify_tokens_per_request_round']:5.2f}"
                         f"  padding {e['padding']:4.0%}  given most often {top}"
                         f" ({e['given'][top]:.0%})  exact " + (
                             "dist (rejection sampling: the distribution, not the tokens)"
                             if e["exact_match"] is None else f"{e['exact_match']:.0%} / "
                             f"{serving['batch_one_match'][B][n]:.0%}"))
    for B, c in serving.get("cost_tables", {}).items():
        v = c["verify_ms"]
        lines.append(f"cost table, batch {B}: verify of 1/2/4/8/16 tokens a row "
                     + "/".join(f"{v[m - 1]:.1f}" for m in (1, 2, 4, 8, 16) if m <= len(v))
                     + f" ms ({v[min(15, len(v) - 1)] / v[0]:.1f}x a plain step at the widest)")
    for B, at in serving.get("measured_ms", {}).items():
        lines.append(f"dspark's measured rule, batch {B}: ms a round at width "
                     + ", ".join(f"{w}: {ms:.1f}" for w, ms in at.items()) + " (0: a plain step)")
    if serving["divergences"]:
        lines.append("\ndivergences from batch-1 plain decoding (float32 near-ties):")
        for d in serving["divergences"][:20]:
            lines.append(f"  B={d['batch_size']} {d['method']}: prompt {d['prompt']} at token "
                         f"{d['position']}, margin {d['margin']:.2e}")
    return "\n".join(lines)
