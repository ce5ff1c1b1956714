"""bench.py end to end on the tiny trained pipeline: every method runs, the JSON follows the
documented schema, and in float64 every drafter reproduces plain decoding exactly."""

import json
import time
from types import SimpleNamespace

import bench
from speculative import DRAFTERS, Stats


def test_bench_runs_every_method_and_writes_the_schema(trained, tmp_path):
    path = tmp_path / "bench.json"
    md = tmp_path / "table.md"
    out = bench.main(["--out-dir", str(trained), "--n-prompts", "3", "--max-new-tokens", "12",
                      "--repeats", "1", "--sweep", "1,3", "--sweep-prompts", "2",
                      "--dtype", "float64", "--json", str(path), "--markdown", str(md),
                      "--plot", str(tmp_path / "bench.png")])
    saved = json.loads(path.read_text())
    assert saved["methods"].keys() == out["methods"].keys()
    for key in ("device", "dtype", "threads", "torch", "k", "sampling", "methods", "sweep",
                "references"):
        assert key in saved
    assert {"ar", *DRAFTERS} <= set(saved["methods"])
    for name, r in saved["methods"].items():
        for key in ("tau", "speedup", "tokens_per_s", "exact_match", "per_position_acceptance"):
            assert key in r, (name, key)
        assert r["exact_match"] == 1.0, name  # float64: token-identical, no near-tie excuses
        assert r["tau"] >= 1.0
    assert saved["methods"]["ar"]["tau"] == 1.0
    for name, rows in saved["sweep"].items():
        assert [r["k"] for r in rows] == [1, 3], name
    assert md.read_text().startswith("| method |")
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # the figure, from the same run


def test_bench_with_coupled_sampling_matches_plain_sampling(trained):
    out = bench.main(["--out-dir", str(trained), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--repeats", "1", "--sweep", "", "--plot", "", "--dtype", "float64",
                      "--sampling", "coupled", "--temperature", "0.9",
                      "--methods", "ar,small,dflash"])
    assert all(r["exact_match"] == 1.0 for r in out["methods"].values())


def test_the_sweep_times_plain_decoding_beside_the_drafters_at_every_k(monkeypatch):
    """At each k, prompt by prompt, plain decoding runs once among the drafters that draft that k
    (ablations aside but the full block), and each speedup is against those runs: timed once up
    front, the drift of a shared machine went into the ratios."""
    calls = []

    def fake_ar(target, prompts, args, cache):
        calls.append("ar")
        time.sleep(1e-4)
        return None, Stats()

    def fake_spec(target, drafter, k, prompts, args, cache):
        calls.append(f"{drafter.name}{k}")
        time.sleep(1e-4)
        return None, Stats(tokens=2, target_forwards=1, rounds=1)

    monkeypatch.setattr(bench, "run_ar", fake_ar)
    monkeypatch.setattr(bench, "run_spec", fake_spec)
    fake = lambda name, max_k: (SimpleNamespace(name=name, max_k=max_k), 1)
    drafters = {"a": fake("a", None), "b": fake("b", 1), "b-full": fake("f", 1),
                "b-threshold": fake("t", 1)}
    args = SimpleNamespace(sweep=[1, 3], sweep_prompts=2)
    out = bench.sweep_k(None, [[1], [2], [3]], drafters, args, "cpu", None)
    assert {n: [r["k"] for r in rows] for n, rows in out.items()} == {
        "a": [1, 3], "b": [1], "b-full": [1]}
    assert all(r["speedup"] > 0 for rows in out.values() for r in rows)
    per_prompt = [calls[0:4], calls[4:8], calls[8:10], calls[10:12]]  # k = 1 twice, k = 3 twice
    assert [sorted(g) for g in per_prompt] == [["a1", "ar", "b1", "f1"]] * 2 + [["a3", "ar"]] * 2
    assert len(calls) == 12
    calls.clear()  # nothing to sweep: nothing runs, not even plain decoding
    assert bench.sweep_k(None, [[1]], {"b-threshold": fake("t", 1)}, args, "cpu", None) == {}
    assert calls == []
