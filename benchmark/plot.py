"""
benchmark/plot.py -- the benchmark's results as one figure.

bench.py measures and prints; this file adds the pictures a reader would rather look at than
read, drawn from bench.py's results (the dict it returns, or the JSON it writes), top to bottom:

  1. speedup over plain decoding and tau (tokens per target forward) of the main methods;
  2. their acceptance by draft position: how fast the draft goes wrong (the share of all
     rounds in which position i survived, so a curve's sum plus one is the drafter's tau);
  3. the ablations (names with a '-': dspark-full, mtp-k1, ...) under the method each changes,
     with a line saying what each one changes: apart, so that none hides a main method;
  4. draft and verify latency per round against k (from the sweep): a drafter that drafts
     token by token pays per token, one that drafts the whole block in one forward barely does.

Every share is a fraction from 0 to 1, as bench.py's tables print them. matplotlib is optional:
it is imported only when drawing (with the Agg backend, so no display is needed), and without
it save() prints how to get it instead of failing the run.

    python -m benchmark.plot out/bench.json                    # redraw a saved run to out/bench.png
    python -m benchmark.plot out/bench.json fig.svg            # or anywhere else
"""

import argparse
import itertools
import json
import os
import sys

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from draft_dspark import THRESHOLD
from draft_lookup import LookupDrafter
from runtime.command import replacing, run
from runtime.settings import ArgumentParser, expand, path_arg

MISSING = "no figure drawn: matplotlib is not installed (pip install matplotlib)"


def save(results, path):
    """Draw `results` to `path`; without matplotlib, say how to get it. True if a figure was
    written."""
    try:
        draw(results, path)
    except ImportError:
        print(MISSING)
        return False
    print(f"figure: {path}")
    return True


LOOKUP_K = LookupDrafter.default_k

# one line per ablation, written under its panel: what was switched off or changed
ABLATIONS = {
    "dspark-full": "DSpark without its scheduler: every round verifies the whole block",
    "dspark-threshold": "DSpark with a fixed rule instead of its scheduler: verify the drafts "
                        f"while their predicted survival is at least {THRESHOLD}",
    "dspark-nomarkov": "DSpark without its Markov head: every slot picked at once, as DFlash does",
    "mtp-k1": "MTP drafting one token a round (the second-token acceptance DeepSeek-V3 reports)",
    "hybrid-lookup": "the hybrid's rule over prompt lookup alone: only the draft's length chosen",
    "hybrid-m1": f"a fixed rule: lookup (k = {LOOKUP_K}) where the text matches, else the learned one",
    "hybrid-m4": f"a fixed rule: lookup (k = {LOOKUP_K}) where 4+ tokens match, else the learned one",
    "hybrid-m8": f"a fixed rule: lookup (k = {LOOKUP_K}) where 8+ tokens match, else the learned one",
}


def is_ablation(name):
    """Ablation variants are named after the method they change: 'dspark-full', 'mtp-k1'."""
    return "-" in name


def explain(name):
    return ABLATIONS.get(name, f"a variant of {name.split('-')[0]} with one part changed")


def colors(names):
    """One color per method, the same in every panel; plain decoding is gray. The main methods
    take the first colors, so adding an ablation never repaints them."""
    from matplotlib import colormaps
    names = sorted(dict.fromkeys(names), key=is_ablation)  # each once, main methods first
    drafters = [n for n in names if n != "ar"]
    palette = list(colormaps["tab10"].colors)
    del palette[7]  # tab10's gray: kept for plain decoding
    if len(drafters) > len(palette):
        palette = list(colormaps["tab20"].colors)
    out = {n: palette[i % len(palette)] for i, n in enumerate(drafters)}
    out["ar"] = "0.5"
    return out


def title(r):
    """What ran where: machine, dtype, commit (when known), and the workload."""
    where = [r.get("device", "?"), r.get("machine"),
             f"{r['threads']} threads" if r.get("threads") else None,
             r.get("dtype"), f"torch {r['torch']}" if r.get("torch") else None,
             f"commit {r['commit']}" if r.get("commit") else None]
    sampling = r.get("sampling", "greedy")
    if sampling != "greedy" and r.get("temperature") is not None:
        sampling += f" T={r['temperature']}"
    what = [f"{r['n_prompts']} prompts × {r['max_new_tokens']} new tokens"
            if "n_prompts" in r else None,
            sampling,
            f"median of {r['repeats']} repeat{'s' * (r['repeats'] != 1)}"
            if r.get("repeats") else None]
    return ("nanospec: speculative decoding against plain decoding\n"
            + " · ".join(w for w in where if w) + "\n" + " · ".join(w for w in what if w))


def ablation_rows(methods):
    """The ablation panel's rows: each method that has ablations (as a reference), then its
    ablations, a gap (None) between groups."""
    rows = []
    for name in methods:
        if is_ablation(name):
            continue
        variants = [n for n in methods if is_ablation(n) and n.split("-")[0] == name]
        if variants:
            rows += ([None] if rows else []) + [name, *variants]
    orphans = [n for n in methods if is_ablation(n) and n not in rows]  # parent did not run
    return rows + ([None] if rows and orphans else []) + orphans


def draw(results, path):
    """The figure: the views() one under another, the run's machine and workload on top.
    Returns the matplotlib Figure, already saved to `path`. A serving sweep (bench.py
    --batch-size) draws draw_serving's figure instead."""
    import matplotlib  # lazily: bench.py runs without it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if "serving" in results:
        return draw_serving(results, path)

    methods = results["methods"]
    sweep = {n: rows for n, rows in (results.get("sweep") or {}).items() if rows}
    rows = views(methods, sweep, colors([*methods, *sweep]))
    with matplotlib.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold",
                                "axes.spines.top": False, "axes.spines.right": False}):
        fig = Figure(figsize=(10, 1 + sum(h for h, _ in rows)), layout="constrained")
        FigureCanvasAgg(fig)
        grid = fig.add_gridspec(len(rows), 1, height_ratios=[h for h, _ in rows])
        for i, (_, view) in enumerate(rows):
            view(fig, grid[i].subgridspec(1, 2))  # each view: one panel, or two side by side
        fig.suptitle(title(results), fontsize=10)
        save_figure(fig, path)
    return fig  # for the tests, which read what each panel shows


def save_figure(fig, path):
    """fig to path whole or not at all; the format is the name's, not the temporary's."""
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=100, format=os.path.splitext(path)[1][1:].lower())


def draw_serving(results, path):
    """The serving sweep: speedup over batched plain decoding against batch size, one line per
    method (DSpark's rules solid, its fixed k dashed, the other drafters dotted), and beside it
    the verify tokens a round spent per request: what each rule bought with the batch's budget."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s = results["serving"]
    # keyed by batch size: ints in the run's dict, strings once through JSON
    Bs, res = s["batch_sizes"], {int(B): r for B, r in s["results"].items()}
    names = [n for n in res[Bs[0]] if n != "ar"]
    color = colors(["ar", *names])
    style = {n: "-" if n in ("dspark", "dspark-cut") else
             "--" if n.startswith("dspark-") else ":" for n in names}
    with matplotlib.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold",
                                "axes.spines.top": False, "axes.spines.right": False}):
        fig = Figure(figsize=(12, 5), layout="constrained")
        FigureCanvasAgg(fig)
        left, right = fig.subplots(1, 2)
        for n in names:
            width = 2.5 if n == "dspark" else 1.3
            left.plot(Bs, [res[B][n]["speedup"] for B in Bs], style[n], marker="o", ms=3,
                      lw=width, color=color[n], label=f"{n} (k={s['k'][n]})")
            right.plot(Bs, [res[B][n]["verify_tokens_per_request_round"] for B in Bs], style[n],
                       marker="o", ms=3, lw=width, color=color[n])
        left.axhline(1.0, color="0.5", lw=1)
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(Bs, [str(B) for B in Bs])
            ax.set_xlabel("batch size (requests decoded together)")
        left.set_title("speedup over batched plain decoding, same batch size")
        left.set_ylabel("speedup (x)")
        right.set_title("verify tokens per request per round")
        right.set_ylabel("tokens (1 = plain decoding)")
        left.legend(fontsize=8, ncol=2)
        fig.suptitle(title(results).replace("against plain decoding",
                                            "over a batch of requests"), fontsize=10)
        save_figure(fig, path)
    return fig


def views(methods, sweep, color):
    """The figure's rows, top to bottom, as (height in inches, draw(fig, spec)): speedup and tau
    of the headline methods (no '-' in the name); their acceptance by position; the ablations
    under the methods they change, each explained in a line; latency against k. The headline
    methods stand alone so that no ablation hides one of them; a view with nothing to show
    (e.g. --sweep '') is left out."""
    headline = {n: r for n, r in methods.items() if not is_ablation(n)}
    ablations = [n for n in methods if is_ablation(n)]
    top = {key: max([r[key] for r in methods.values()] + [1]) * 1.2 for key in ("speedup", "tau")}
    out = [(1.2 + 0.35 * len(headline),
            lambda fig, g: speed_and_tau(fig, g, headline, list(headline), color, top, ""))]
    if any(r.get("per_position_acceptance") for r in headline.values()):
        out.append((4, lambda fig, g: acceptance(fig.add_subplot(g[:]), headline, color)))
    if ablations:
        rows = ablation_rows(methods)
        out.append((1.2 + 0.35 * len(rows),
                    lambda fig, g: speed_and_tau(fig, g, methods, rows, color, top, "ablations: ")))
        out.append((0.2 + 0.2 * (1 + len(ablations)),
                    lambda fig, g: notes(fig.add_subplot(g[:]), ablations)))
    if sweep:
        out.append((4, lambda fig, g: latencies(fig, g, sweep, color)))
    return out


def speed_and_tau(fig, g, methods, rows, color, top, heading):
    """Two bar panels side by side, speedup and tau, one bar per row (on shared scales)."""
    bars(fig.add_subplot(g[0, 0]), methods, rows, color, "speedup", "{:.2f}×", top["speedup"],
         heading + "speedup over plain decoding", "× plain decoding's tokens/s (median)",
         at_one=True)
    bars(fig.add_subplot(g[0, 1]), methods, rows, color, "tau", "{:.2f}", top["tau"],
         heading + "τ: tokens per target forward", "tokens per target forward (bonus included)",
         labelled=False)


def bars(ax, methods, rows, color, key, fmt, right, heading, xlabel, labelled=True,
         at_one=False):
    """A horizontal bar per row (None: a gap), its value written at the bar's end (names on the
    left panel only)."""
    y = [i for i, n in enumerate(rows) if n is not None]
    names = [n for n in rows if n is not None]
    values = [methods[n][key] for n in names]
    ax.barh(y, values, color=[color[n] for n in names], height=0.7)
    ax.set_yticks(y, names if labelled else [""] * len(names))
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top, as in the printed table
    for yi, v in zip(y, values):
        ax.text(v, yi, " " + fmt.format(v), va="center", fontsize=9, zorder=3,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))  # readable over 1x line
    ax.set_xlim(0, right)  # room for the value labels
    if at_one:
        ax.axvline(1, color="0.3", lw=1, ls="--")
    ax.set_title(heading, loc="left")
    ax.set_xlabel(xlabel)


def notes(ax, ablations):
    """One line per ablation: what it switches off, so the bars above need no README."""
    ax.axis("off")
    lines = ["The ablations above, each under the method it changes:"]
    lines += [f"    {n}: {explain(n)}" for n in ablations]
    ax.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=9, linespacing=1.6,
            transform=ax.transAxes)


def acceptance(ax, methods, color):
    """Per drafter, the share of all rounds in which draft position i survived (plain decoding
    drafts nothing): a curve's sum plus one is the drafter's tau."""
    drafters = [(n, r) for n, r in methods.items() if r.get("per_position_acceptance")]
    for (name, r), marker in zip(drafters, itertools.cycle("osD^vP")):
        acc = r["per_position_acceptance"]
        # a marker of its own: where two curves meet, both still show; clip_on=False: 0 and 1 too
        ax.plot(range(1, len(acc) + 1), acc, marker=marker, ms=5, color=color[name],
                label=f"{name} (k = {r['k']})", clip_on=False)
    ax.set_title("acceptance by draft position (τ = 1 + the sum of a curve)", loc="left")
    ax.set_xlabel("draft position i (1 = the first drafted token)")
    ax.set_ylabel("share of all rounds in\nwhich position i survived")
    ax.set_ylim(0, 1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9)


def latencies(fig, g, sweep, color):
    """Draft and verify milliseconds per round against k, on one shared scale."""
    top = max(s[key] for rows in sweep.values() for s in rows for key in ("draft_ms", "verify_ms"))
    latency(fig.add_subplot(g[0, 0]), sweep, color, "draft_ms", "draft latency against k", top,
            legend=True)
    latency(fig.add_subplot(g[0, 1]), sweep, color, "verify_ms",
            "verify latency against k (one target forward)", top)


def latency(ax, sweep, color, key, heading, top, legend=False):
    """Milliseconds per round against k, one line per swept drafter. An ablation (DSpark's full
    block) is thin, dashed, with hollow markers, on top of its method's thick line: where both
    cost the same (the same network drafts), both stay visible."""
    for name, rows in sweep.items():
        style = (dict(ls="--", lw=1.2, ms=7, mfc="none", zorder=3) if is_ablation(name)
                 else dict(ls="-", lw=2.2, ms=4, zorder=2))
        # clip_on=False: a drafter that costs nothing (lookup) lies on the axis, still visible
        ax.plot([s["k"] for s in rows], [s[key] for s in rows], marker="o",
                color=color[name], label=name, clip_on=False, **style)
    ax.set_title(heading, loc="left")
    ax.set_xlabel("k (tokens drafted per round)")
    ax.set_ylabel("ms per round")
    ax.set_ylim(0, 1.1 * top if top > 0 else 1)
    ax.set_xticks(sorted({s["k"] for rows in sweep.values() for s in rows}))
    if legend:
        ax.legend(loc="upper left", frameon=False, fontsize=9)


def image_path(text):
    """An image file to draw to ('' for none), checked before the work, not after it."""
    if text and os.path.splitext(text)[1].lower() not in (".png", ".svg", ".pdf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a .png, .svg or .pdf file name")
    return text and path_arg("out")(text)


def main(argv=None):
    p = ArgumentParser(prog="python -m benchmark.plot",
                       description="Draw bench.py's figure from the JSON it wrote "
                                   "(OUT_DIR/bench.json, or bench.py --json).")
    p.add_argument("json", type=expand, help="a results file written by bench.py")
    p.add_argument("image", nargs="?", default=None, type=image_path,
                   help="where to draw (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    try:
        with open(args.json) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {args.json}: {e}")
    try:
        drawn = save(results, args.image or image_path(os.path.splitext(args.json)[0] + ".png"))
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"error: cannot draw beside {args.json}: {e}; name an image to draw to")
    except OSError as e:
        raise SystemExit(f"error: cannot write the figure: {e}")
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise SystemExit(f"error: {args.json} is not a results file bench.py wrote "
                         f"({type(e).__name__}: {e}): give benchmark/plot.py OUT_DIR/bench.json or "
                         "OUT_DIR/serving.json")
    if not drawn:
        raise SystemExit(1)


if __name__ == "__main__":
    run(main)
