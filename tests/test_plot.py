"""benchmark/plot.py: the figure is drawn from bench.py's results (a run's dict or its JSON), for
any set
of methods: the headline methods on top, the ablations apart and explained, no line hidden
under another, every share a fraction; without matplotlib the bench still finishes, saying how
to get the figure."""

import argparse
import json
import sys

import pytest

from benchmark import report
from benchmark import plot


def results():
    """A run's results as bench.py returns them, kept small; "lookup" drafts for free and once
    offered nothing (no acceptance to show), DSpark's full block repeats DSpark's numbers
    exactly (as in a real run where its scheduler cut nothing), "small-odd" is an ablation the
    figure has no words for, and the run has no commit (not a git checkout)."""
    def method(k, tau, speedup, acc, draft_ms):
        return {"k": k, "tau": tau, "speedup": speedup, "tokens_per_s": 600 * speedup,
                "exact_match": 1.0, "per_position_acceptance": acc, "mean_drafted": float(k),
                "draft_ms_per_round": draft_ms, "verify_ms_per_round": 3.0, "draft_share": 0.3,
                "seconds": 5.0, "budget": []}
    methods = {
        "ar": method(0, 1.0, 1.0, [], 0.0),
        "small": method(3, 2.5, 1.3, [0.8, 0.6, 0.4], 1.2),
        "dspark": method(7, 3.1, 1.6, [0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1], 1.5),
        "dspark-full": method(7, 3.1, 1.6, [0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1], 1.5),
        "dspark-nomarkov": method(7, 1.9, 1.1, [0.5, 0.2, 0.1, 0.05, 0.03, 0.01, 0.01], 1.5),
        "lookup": method(4, 1.0, 0.9, [], 0.0),
        "small-odd": method(2, 2.0, 1.1, [0.7, 0.3], 0.8),
    }

    def rows(ks, ms):
        return [{"k": k, "block_size": k + 1, "draft_ms": ms(k), "verify_ms": 3.0, "tau": 2.0,
                 "speedup": 1.2} for k in ks]
    sweep = {"small": rows((1, 2, 4), lambda k: 0.5 * k), "lookup": rows((2,), lambda k: 0.0),
             "dspark": rows((1, 2, 4), lambda k: 1.5),
             "dspark-full": rows((1, 2, 4), lambda k: 1.5)}
    return {"device": "cpu", "machine": "Some CPU", "commit": None, "dtype": "float32",
            "threads": 2, "torch": "2.13.0", "k": None, "sampling": "greedy", "temperature": 1.0,
            "n_prompts": 4, "max_new_tokens": 16, "repeats": 1, "methods": methods, "sweep": sweep,
            "divergences": [], "references": []}


def panel(fig, heading):
    """The axes whose (left) title starts with `heading`."""
    found = [ax for ax in fig.axes if ax.get_title(loc="left").startswith(heading)]
    assert len(found) == 1, [ax.get_title(loc="left") for ax in fig.axes]
    return found[0]


def names_on(ax):
    return [t.get_text() for t in ax.get_yticklabels()]


def is_png(path):
    return (path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            and path.stat().st_size > 10_000)


def test_draws_a_png_from_results(tmp_path, capsys):
    path = tmp_path / "bench.png"
    assert plot.save(results(), str(path))
    assert is_png(path)
    assert capsys.readouterr().out == f"figure: {path}\n"


def test_headline_methods_on_top_ablations_apart_each_explained(tmp_path):
    fig = plot.draw(results(), str(tmp_path / "bench.png"))
    assert names_on(panel(fig, "speedup")) == ["ar", "small", "dspark", "lookup"]
    # each ablation under the method it changes; one whose method did not run, after a gap
    assert names_on(panel(fig, "ablations: speedup")) == [
        "small", "small-odd", "dspark", "dspark-full", "dspark-nomarkov"]
    notes = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "dspark-full: DSpark without its scheduler" in notes
    assert "dspark-nomarkov: DSpark without its Markov head" in notes
    assert "small-odd: a variant of small" in notes  # no words for it: still named


def test_acceptance_shows_headline_drafters_as_fractions_of_all_rounds(tmp_path):
    """No ablation in the acceptance panel (dspark-full's curve would hide DSpark's), each
    curve with its own marker, and shares from 0 to 1 as the tables print them."""
    ax = panel(plot.draw(results(), str(tmp_path / "bench.png")), "acceptance")
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["small (k = 3)", "dspark (k = 7)"]
    assert len({line.get_marker() for line in ax.lines}) == len(ax.lines)
    assert ax.get_ylim() == (0, 1) and "all rounds" in ax.get_ylabel()
    assert all(0 <= y <= 1 for line in ax.lines for y in line.get_ydata())


def test_no_sweep_line_hides_another(tmp_path):
    """DSpark's full block drafts with DSpark's own network, so both cost the same: the ablation
    is thin and dashed on top of DSpark's thick line, and the axis names k for what it is."""
    fig = plot.draw(results(), str(tmp_path / "bench.png"))
    for heading in ("draft latency", "verify latency"):
        ax = panel(fig, heading)
        lines = {line.get_label(): line for line in ax.lines}
        full, dspark = lines["dspark-full"], lines["dspark"]
        assert list(full.get_ydata()) == list(dspark.get_ydata())  # the case in question
        assert full.get_linestyle() == "--" and dspark.get_linestyle() == "-"
        assert full.get_linewidth() < dspark.get_linewidth()
        assert full.get_zorder() > dspark.get_zorder()
        assert ax.get_xlabel() == "k (tokens drafted per round)"


def test_draws_without_a_sweep_or_any_drafter(tmp_path):
    r = results()
    r["sweep"], r["methods"] = {}, {"ar": r["methods"]["ar"]}
    assert plot.save(r, str(tmp_path / "ar.png")) and is_png(tmp_path / "ar.png")


def test_title_names_machine_dtype_and_commit_only_when_known():
    r = results()
    assert "Some CPU" in plot.title(r) and "float32" in plot.title(r)
    assert "commit" not in plot.title(r)
    r["commit"] = "abc1234"
    assert "commit abc1234" in plot.title(r)


def test_plot_py_redraws_from_bench_json(tmp_path):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(results()))
    plot.main([str(src)])  # default: beside the JSON
    assert is_png(tmp_path / "bench.png")


def test_without_matplotlib_bench_says_how_to_get_the_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    args = argparse.Namespace(json=str(tmp_path / "b.json"), markdown=None, plot=None,
                              out_dir=str(tmp_path))
    report.write(results(), args)  # the last step of a run: must not raise
    assert capsys.readouterr().out == f"results: {tmp_path / 'b.json'}\n{plot.MISSING}\n"
    assert "pip install matplotlib" in plot.MISSING
    assert (tmp_path / "b.json").exists() and not (tmp_path / "bench.png").exists()
    with pytest.raises(SystemExit):  # benchmark/plot.py alone: the same line, then a failing exit
        plot.main([str(tmp_path / "b.json")])
    assert capsys.readouterr().out == plot.MISSING + "\n"


def test_bench_writes_its_json_beside_the_checkpoints_and_plot_py_redraws_it(tmp_path):
    """bench.py's defaults: OUT_DIR/bench.json and OUT_DIR/bench.png, so that the README's
    `python -m benchmark.plot out/bench.json` finds the run; '' skips either file."""
    args = argparse.Namespace(json=None, markdown=None, plot="", out_dir=str(tmp_path))
    report.write(results(), args)
    assert json.loads((tmp_path / "bench.json").read_text()) == results()
    plot.main([str(tmp_path / "bench.json")])
    assert is_png(tmp_path / "bench.png")
    skip = tmp_path / "skip"
    skip.mkdir()
    report.write(results(), argparse.Namespace(json="", markdown=None, plot="", out_dir=str(skip)))
    assert not list(skip.iterdir())


def test_run_metadata():
    assert report.machine("cpu")
    c = report.commit()
    assert c is None or (isinstance(c, str) and c)


@pytest.mark.parametrize("foreign", [{"methods": 3}, {"serving": {"batch_sizes": [1]}}, [1, 2],
                                     {"methods": {"ar": {"speedup": 1.0}}}])
def test_plot_py_on_a_json_of_another_shape_is_one_error_line(tmp_path, foreign):
    src = tmp_path / "other.json"
    src.write_text(json.dumps(foreign))
    with pytest.raises(SystemExit) as e:
        plot.main([str(src)])
    assert str(e.value.code).startswith("error: ") and "OUT_DIR/bench.json" in str(e.value.code)
