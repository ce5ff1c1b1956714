"""
benchmark/report.py -- what bench.py prints and writes: progress lines while it runs; once the timed
runs are done, the tables, the papers' figures beside ours, the divergences, the markdown table,
the JSON and the figure, and the machine and commit every number is named with.
"""

import argparse
import json
import os
import platform
import subprocess
import time

import torch

from benchmark import plot
from runtime.command import atomic_write
from runtime.settings import path_arg


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


class Progress:
    """Progress lines, each with an estimate of what is left. Work is counted in prompts run by
    one method, each weighed by that method's seconds per prompt in the warm-up; what is left
    is the weighed work still planned, at the pace the work done so far took."""

    def __init__(self, per_prompt):
        self.per_prompt, self.planned, self.done = per_prompt, 0.0, 0.0
        self.start = time.perf_counter()

    def plan(self, names, n_prompts):
        self.planned += n_prompts * sum(self.per_prompt.get(n, 0.0) for n in names)

    def did(self, names, n_prompts=1):
        self.done += n_prompts * sum(self.per_prompt.get(n, 0.0) for n in names)

    def line(self, text):
        left = (time.perf_counter() - self.start) * max(0.0, self.planned - self.done) / max(
            self.done, 1e-9)
        print(f"{text} | about {int(left // 60)}m{int(left % 60):02d}s left", flush=True)


def bar(x, scale, width=40):
    return "█" * max(1, round(width * x / scale)) if scale > 0 else ""


def exact(r):
    """The exact column: the share of outputs identical to plain decoding's, or "dist" where
    none is compared (rejection sampling keeps the target's distribution, not its tokens)."""
    return "dist" if r["exact_match"] is None else f"{r['exact_match']:.0%}"


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
                     f"{exact(r):>7}  {acc}")
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
                    f"| {exact(r)} | {budget_text(r['budget'])} |")
    return "\n".join(rows)


def print_report(out, header):
    """Everything printed after the timed runs: the tables, the papers' figures, any divergences."""
    print()
    print(report(out["methods"], out["sweep"], header))
    if out["references"]:
        print(f"\nthe papers' figures beside ours (theirs: GPU and multi-billion-parameter "
              f"targets; ours: {out['device']}, {out['dtype']})")
        wm = max(len(r["method"]) for r in out["references"]) + 2
        ww = max(len(r["what"]) for r in out["references"]) + 1
        for r in out["references"]:
            print(f"  {r['method']:<{wm}}{r['what']:<{ww}} paper {r['paper']:<18} "
                  f"ours {r['ours']:<14} [{r['source']}]")
    if any(r["exact_match"] is None for r in out["methods"].values()):
        print("\nexact \"dist\": rejection sampling keeps the target's distribution, not plain "
              "decoding's tokens, so no output is compared here; tests/test_speculative.py "
              "checks the distribution (greedy and coupled runs check every token)")
    if out["divergences"]:
        print("\ndivergences from plain decoding (first differing token; small margins are float "
              "near-ties):")
        for dv in out["divergences"]:
            print(f"  {dv['method']}: prompt {dv['prompt']} at token {dv['position']}, "
                  f"target logit margin {dv['margin']:.2e}")
    print("\n" + markdown(out["methods"]))


def outputs(args, stem="bench"):
    """{flag: file} that write() writes, '' or None for none: by default the JSON and the figure
    beside the checkpoints (OUT_DIR/bench.json and OUT_DIR/bench.png, so that `python -m
    benchmark.plot out/bench.json` redraws the figure; the serving sweep's stem is "serving"), and
    the one-request bench's markdown table when asked for."""
    return {"--json": os.path.join(args.out_dir, f"{stem}.json") if args.json is None else args.json,
            "--plot": os.path.join(args.out_dir, f"{stem}.png") if args.plot is None else args.plot,
            "--markdown": args.markdown if stem == "bench" else None}


def check_outputs(args, stem="bench"):
    """Refuse, before minutes of benchmarking, a file write() could not write at the end."""
    for flag, path in outputs(args, stem).items():
        try:
            path and path_arg("out")(path)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{flag} {e}: pass {flag} with a file you can write"
                             + ("" if flag == "--markdown" else f", or {flag} '' to skip it"))


def write(out, args, stem="bench"):
    """The files of outputs(); one that still cannot be written ends in an error line after the
    others are written (the results are on the screen above it)."""
    failed = []
    for flag, path in outputs(args, stem).items():
        if not path or (flag == "--markdown" and "methods" not in out):
            continue
        try:
            if flag == "--plot":
                plot.save(out, path)  # without matplotlib: one line saying how to get it
                continue
            atomic_write(path, json.dumps(out, indent=2) if flag == "--json"
                         else markdown(out["methods"]) + "\n")
            print(f"results: {path}" if flag == "--json" else f"table: {path}")
        except OSError as e:
            failed.append(f"{path} ({e.strerror or e})")
    if failed:
        raise ValueError(f"could not write {', '.join(failed)}; the results are printed above")
