"""
plot.py -- the benchmark's results as one figure.

bench.py measures and prints; this file adds the pictures a reader would rather look at than
read, drawn from bench.py's results (the dict it returns, or the JSON it writes):

  1. speedup over plain decoding and tau (tokens per target forward) per method;
  2. acceptance by draft position per drafter: how fast the draft goes wrong;
  3. draft and verify latency per round against k (from the sweep): a drafter that drafts
     token by token pays per token, one that drafts the whole block in one forward barely does.

matplotlib is optional: it is imported only when drawing (with the Agg backend, so no display
is needed), and without it save() prints how to get it instead of failing the run.

    python plot.py out/bench.json out/bench.png      # redraw from a saved run
"""

import json
import os

from gpt import ArgumentParser

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


def colors(names):
    """One color per method, the same in every panel; plain decoding is gray."""
    from matplotlib import colormaps
    drafters = [n for n in dict.fromkeys(names) if n != "ar"]  # each once, in order
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


def draw(results, path):
    """The figure: per-method bars on top, then acceptance by position, then latency against k
    (a view with nothing to show, e.g. a run with --sweep '', is left out)."""
    import matplotlib  # lazily: bench.py runs without it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    methods = results["methods"]
    sweep = {n: rows for n, rows in (results.get("sweep") or {}).items() if rows}
    color = colors([*methods, *sweep])
    accepted = any(r.get("per_position_acceptance") for r in methods.values())
    heights = [1.2 + 0.35 * len(methods)]  # inches per row: the bars, then each view that has data
    heights += [4] if accepted else []
    heights += [4] if sweep else []
    with matplotlib.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.titleweight": "bold",
                                "axes.spines.top": False, "axes.spines.right": False}):
        fig = Figure(figsize=(10, 1 + sum(heights)), layout="constrained")
        FigureCanvasAgg(fig)
        grid = fig.add_gridspec(len(heights), 2, height_ratios=heights)
        bars(fig.add_subplot(grid[0, 0]), methods, color, "speedup", "{:.2f}×",
             "speedup over plain decoding", "× plain decoding's tokens/s (median)", at_one=True)
        bars(fig.add_subplot(grid[0, 1]), methods, color, "tau", "{:.2f}",
             "τ: tokens per target forward", "tokens per target forward (bonus included)",
             labelled=False)
        if accepted:
            acceptance(fig.add_subplot(grid[1, :]), methods, color)
        if sweep:
            top = max(s[key] for rows in sweep.values() for s in rows
                      for key in ("draft_ms", "verify_ms"))
            latency(fig.add_subplot(grid[-1, 0]), sweep, color, "draft_ms",
                    "draft latency against k", top, legend=True)
            latency(fig.add_subplot(grid[-1, 1]), sweep, color, "verify_ms",
                    "verify latency against k (one target forward)", top)
        fig.suptitle(title(results), fontsize=10)
        fig.savefig(path, dpi=100)


def bars(ax, methods, color, key, fmt, heading, xlabel, labelled=True, at_one=False):
    """A horizontal bar per method, its value written at the bar's end (names on the left panel
    only)."""
    names = list(methods)
    values = [methods[n][key] for n in names]
    y = range(len(names))
    ax.barh(y, values, color=[color[n] for n in names], height=0.7)
    ax.set_yticks(list(y), names if labelled else [""] * len(names))
    ax.invert_yaxis()  # first method on top, as in the printed table
    for yi, v in zip(y, values):
        ax.text(v, yi, " " + fmt.format(v), va="center", fontsize=9, zorder=3,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))  # readable over 1x line
    ax.set_xlim(0, max(values + [1]) * 1.2)  # room for the value labels
    if at_one:
        ax.axvline(1, color="0.3", lw=1, ls="--")
    ax.set_title(heading, loc="left")
    ax.set_xlabel(xlabel)


def acceptance(ax, methods, color):
    """Share of rounds in which draft position i survived, per drafter (plain decoding drafts
    nothing)."""
    for name, r in methods.items():
        acc = r.get("per_position_acceptance") or []
        if acc:
            # clip_on=False: 0% and 100% stay visible
            ax.plot(range(1, len(acc) + 1), [100 * a for a in acc], marker="o", ms=4,
                    color=color[name], label=f"{name} (k = {r['k']})", clip_on=False)
    ax.set_title("acceptance by draft position", loc="left")
    ax.set_xlabel("draft position i (1 = the first drafted token)")
    ax.set_ylabel("rounds in which position i\nwas accepted (%)")
    ax.set_ylim(0, 100)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=9)


def latency(ax, sweep, color, key, heading, top, legend=False):
    """Milliseconds per round against k, one line per swept drafter; both panels share 0..top."""
    for name, rows in sweep.items():
        # clip_on=False: a drafter that costs nothing (lookup) lies on the axis, still visible
        ax.plot([s["k"] for s in rows], [s[key] for s in rows], marker="o", ms=4,
                color=color[name], label=name, clip_on=False)
    ax.set_title(heading, loc="left")
    ax.set_xlabel("k: tokens drafted per round (block size k + 1)")
    ax.set_ylabel("ms per round")
    ax.set_ylim(0, 1.1 * top if top > 0 else 1)
    ax.set_xticks(sorted({s["k"] for rows in sweep.values() for s in rows}))
    if legend:
        ax.legend(loc="upper left", frameon=False, fontsize=9)


def main(argv=None):
    p = ArgumentParser(description="Draw bench.py's figures from the JSON it wrote "
                                   "(bench.py --json).")
    p.add_argument("json", help="a results file written by bench.py --json")
    p.add_argument("image", nargs="?", default=None,
                   help="where to draw (default: the JSON's path with .png)")
    args = p.parse_args(argv)
    try:
        with open(args.json) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read {args.json}: {e}")
    if not save(results, args.image or os.path.splitext(args.json)[0] + ".png"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
