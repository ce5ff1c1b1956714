"""
benchmark/data_curve.py -- what data buys a learned drafter: τ against the size of its training
set.

Each point is one out-dir trained with a different --gen-seqs (the same recipe otherwise) and
benched on held-out chat requests: its chat set's tokens (distill.pt), the drafter's training
steps and seconds (its checkpoint's budget), and τ from each bench JSON named bench-<prompts>.json
in the out-dir. Writes the points as JSON and, with matplotlib, a figure.

    python -m benchmark.data_curve c50 c200 c800 c1600 --json curve.json --png curve.png
"""

import argparse
import json
import os
import sys

import torch

from benchmark.plot import save_figure


def point(out_dir, drafter):
    """One out-dir -> {tokens, requests, answers, steps, train_seconds, tau: {prompts: τ}}."""
    chat_set = torch.load(os.path.join(out_dir, "distill.pt"), map_location="cpu",
                          weights_only=True)
    settings = chat_set["settings"]  # what training/distill.py built it with
    ckpt = torch.load(os.path.join(out_dir, f"{drafter}.pt"), map_location="cpu",
                      weights_only=True)
    taus = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("bench-") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                methods = json.load(f).get("methods", {})
            if drafter not in methods:
                sys.exit(f"error: {name} in {out_dir} has no {drafter} row: bench it with "
                         f"--methods {drafter} --json {os.path.join(out_dir, name)}")
            taus[name[len("bench-"):-len(".json")]] = methods[drafter]["tau"]
    return {"out_dir": out_dir, "tokens": chat_set["tokens"].numel(),
            "requests": settings.get("requests", "stdlib"),
            "answers": settings.get("answers", "target"), "steps": ckpt["budget"]["steps"],
            "train_seconds": ckpt["budget"]["seconds"], "tau": taus}


def draw(points, path, drafter):
    """τ against the set's tokens (log scale), one line per prompt set and kind of answers (the
    target's own, or the conversations' given ones)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for color, prompts in enumerate(sorted({p for pt in points for p in pt["tau"]})):
        for answers in sorted({pt["answers"] for pt in points}):
            line = [pt for pt in points if pt["answers"] == answers and prompts in pt["tau"]]
            ax.plot([pt["tokens"] for pt in line], [pt["tau"][prompts] for pt in line],
                    "o-" if answers == "given" else "s", color=f"C{color}", mfc="white"
                    if answers != "given" else None, label=f"{prompts}, {answers} answers")
    ax.set_xscale("log")
    ticks = []  # a tick a size, none within 20% of the one before (they would overprint)
    for n in sorted(pt["tokens"] for pt in points):
        if not ticks or n > 1.2 * ticks[-1]:
            ticks.append(n)
    ax.set_xticks(ticks, [f"{n / 1000:.0f}k" for n in ticks])
    ax.minorticks_off()
    ax.set_ylim(bottom=1.0)  # plain decoding's τ
    ax.set_xlabel("training set (tokens)")
    ax.set_ylabel(f"τ of {drafter} (tokens per target forward)")
    ax.set_title(f"{drafter}: what data buys ({points[0]['steps']} steps each)")
    ax.legend()
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("out_dirs", nargs="+", help="one out-dir a point")
    ap.add_argument("--drafter", default="dflash", help="the drafter whose τ is drawn")
    ap.add_argument("--json", default="data_curve.json", help="where the points go")
    ap.add_argument("--png", default=None, help="the figure (default: none)")
    args = ap.parse_args(argv)
    for d in args.out_dirs:
        for name in ("distill.pt", f"{args.drafter}.pt"):
            if not os.path.exists(os.path.join(d, name)):
                sys.exit(f"error: {d} holds no {name}: train it first (train.py --out-dir {d})")
    points = sorted((point(d, args.drafter) for d in args.out_dirs), key=lambda p: p["tokens"])
    with open(args.json, "w") as f:
        json.dump(points, f, indent=1)
    for p in points:
        print(f"{p['out_dir']}: {p['tokens']:,} tokens ({p['requests']}, {p['answers']} answers), "
              f"{p['steps']} steps in {p['train_seconds']} s, τ " +
              ", ".join(f"{k} {v:.2f}" for k, v in p["tau"].items()))
    if args.png:
        draw(points, args.png, args.drafter)


if __name__ == "__main__":
    main()
