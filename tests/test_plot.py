"""plot.py: the figure is drawn from bench.py's results (a run's dict or its JSON), for any set
of methods, and without matplotlib the bench still finishes, saying how to get the figure."""

import argparse
import json
import sys

import bench
import plot


def results():
    """A run's results as bench.py returns them, kept small; "lookup" drafts for free and once
    offered nothing (no acceptance to show), and the run has no commit (not a git checkout)."""
    def method(k, tau, speedup, acc, draft_ms):
        return {"k": k, "tau": tau, "speedup": speedup, "tokens_per_s": 600 * speedup,
                "exact_match": 1.0, "per_position_acceptance": acc, "mean_drafted": float(k),
                "draft_ms_per_round": draft_ms, "verify_ms_per_round": 3.0, "draft_share": 0.3,
                "seconds": 5.0, "budget": []}
    methods = {
        "ar": method(0, 1.0, 1.0, [], 0.0),
        "small": method(3, 2.5, 1.3, [0.8, 0.6, 0.4], 1.2),
        "dspark-nomarkov": method(7, 3.1, 1.1, [0.9] * 7, 1.5),
        "lookup": method(4, 1.0, 0.9, [], 0.0),
    }
    sweep = {
        "small": [{"k": k, "block_size": k + 1, "draft_ms": 0.5 * k, "verify_ms": 3.0, "tau": 2.0,
                   "speedup": 1.2} for k in (1, 2, 4)],
        "lookup": [{"k": 2, "block_size": 3, "draft_ms": 0.0, "verify_ms": 2.9, "tau": 1.0,
                    "speedup": 0.9}],
    }
    return {"device": "cpu", "machine": "Some CPU", "commit": None, "dtype": "float32",
            "threads": 2, "torch": "2.13.0", "k": None, "sampling": "greedy", "temperature": 1.0,
            "n_prompts": 4, "max_new_tokens": 16, "repeats": 1, "methods": methods, "sweep": sweep,
            "divergences": [], "references": []}


def is_png(path):
    return (path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            and path.stat().st_size > 10_000)


def test_draws_a_png_from_results(tmp_path, capsys):
    path = tmp_path / "bench.png"
    assert plot.save(results(), str(path))
    assert is_png(path)
    assert capsys.readouterr().out == f"figure: {path}\n"


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
    bench.write(results(), args)  # the last step of a run: must not raise
    assert capsys.readouterr().out == plot.MISSING + "\n"
    assert "pip install matplotlib" in plot.MISSING
    assert (tmp_path / "b.json").exists() and not (tmp_path / "bench.png").exists()


def test_run_metadata():
    assert bench.machine("cpu")
    c = bench.commit()
    assert c is None or (isinstance(c, str) and c)
