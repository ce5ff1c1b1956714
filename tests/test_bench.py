"""bench.py end to end on the tiny trained pipeline: every method runs, the JSON follows the
documented schema, and in float64 every drafter reproduces plain decoding exactly."""

import json

import bench
from speculative import DRAFTERS


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
