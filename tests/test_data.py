"""Tests for training/data.py. The stdlib tokenizer is trained once per session on the FULL default
corpus (~3 s)."""
import json
import os
import pathlib
import sys
from collections import Counter

import numpy as np
import pytest
import tiktoken
import tiktoken.load

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from training import data  # noqa: E402
from formats import tokenizer  # noqa: E402
from training import tokenizer as bpe  # noqa: E402
from benchmark import prompt_sets  # noqa: E402
from training.data import DataError
from formats.tokenizer import EOT  # noqa: E402

SMALL = ["def foo(x):\n    return x + 1\n", "class Bar:\n    pass\n\n\n",
         "foo foo foo  bar\tbaz 12345\r\n",
         "caf\u00e9 na\u00efve \u4e2d\u6587 \u00a0nbsp \x1cfs\x85nel \U0001f600!!\n"]


@pytest.fixture(scope="module")
def corpus():
    return data.load_documents()


@pytest.fixture(scope="module")
def stdlib_enc(corpus, tmp_path_factory):
    ranks = bpe.train_bpe(corpus[0], data.DEFAULT_VOCAB)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.tiktoken"
    tokenizer.save_tokenizer(ranks, path)
    return ranks, tokenizer.load_tokenizer(path)


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_data")
    for i in range(30):  # enough files that the 5% hash split picks at least one
        text = "".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40))
        (folder / f"f{i:02d}.py").write_text(text)
    out = tmp_path_factory.mktemp("small_out")
    return folder, out, data.prepare_data(out, str(folder), vocab_size=300, verbose=False)


# -----------------------------------------------------------------------------
# corpus

def test_stdlib_files_skip_tests_and_site_packages():
    files = data.stdlib_files()
    assert files == sorted(files) and len(files) > 500
    bad = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    assert not any(bad & set(p.parts) for p in files)
    assert any(p.name == "heapq.py" for p in files)


def test_split_is_deterministic_and_by_file(corpus):
    train, val = corpus
    assert len(val) >= 1 and len(train) > 10 * len(val)
    assert data.load_documents() == corpus


def _bad_source(tmp: pathlib.Path, kind: str) -> pathlib.Path:
    path = tmp / kind
    if kind == "empty_folder":
        path.mkdir()
    elif kind == "empty_file":
        path.write_text("")
    elif kind == "binary_file":
        path.write_bytes(b"abc\0\x01\x02")
    elif kind == "binary_folder":
        path.mkdir()
        (path / "x.bin").write_bytes(b"\xff\xfe\0")
        (path / "y.txt").write_bytes("caf\u00e9".encode("latin-1"))
    return path


@pytest.mark.parametrize("kind, msg", [("missing", "does not exist"), ("empty_folder", "is empty"),
                                       ("empty_file", "is empty"), ("binary_file", "not UTF-8"),
                                       ("binary_folder", "none is non-empty UTF-8")])
def test_load_documents_errors(tmp_path, kind, msg):
    with pytest.raises(DataError, match=msg) as e:
        data.load_documents(str(_bad_source(tmp_path, kind)))
    assert str(e.value).count(". ") == 0  # one sentence


def test_single_file_is_split_by_lines(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("".join(f"line {i}\n" for i in range(1000)))
    train, val = data.load_documents(str(f))
    assert len(val) >= 1 and len(train) >= 10
    docs = sorted(train + val, key=lambda d: int(d.split()[1]))
    assert "".join(docs) == f.read_text()  # nothing lost


def test_folder_skips_binary_and_hidden(tmp_path):
    for i in range(5):
        (tmp_path / f"{i}.txt").write_text(f"doc {i}\n")
    (tmp_path / "x.bin").write_bytes(b"\0\1\2")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: secret\n")
    train, val = data.load_documents(str(tmp_path))
    assert sorted(train + val) == [f"doc {i}\n" for i in range(5)]


# -----------------------------------------------------------------------------
# tokenizer

def test_stdlib_tokenizer_round_trips_every_val_doc(corpus, stdlib_enc):
    ranks, enc = stdlib_enc
    assert len(ranks) == data.DEFAULT_VOCAB - 1 and enc.n_vocab == data.DEFAULT_VOCAB
    for doc in corpus[1]:
        assert tokenizer.decode(enc, tokenizer.encode(enc, doc)) == doc


def test_regex_split_matches_tiktoken(corpus):
    # give tiktoken a vocab with every training-side chunk as one token: it then emits exactly
    # one token per piece of ITS split, so equal token lists <=> identical splits
    docs = corpus[0][::3] + corpus[1] + SMALL
    chunks = [[c.encode() for c in bpe._SPLIT.findall(d)] for d in docs]
    ranks = {bytes([i]): i for i in range(256)}
    for c in sorted({c for cs in chunks for c in cs} - set(ranks)):
        ranks[c] = len(ranks)
    enc = tiktoken.Encoding(name="split", pat_str=tokenizer.PAT, mergeable_ranks=ranks,
                            special_tokens={})
    for d, cs in zip(docs, chunks):
        assert enc.decode_tokens_bytes(enc.encode_ordinary(d)) == cs


def _reference_bpe(texts, vocab_size):
    """Slow, obviously-correct BPE: recount every pair after every merge."""
    words = Counter(tuple(c.encode()) for t in texts for c in bpe._SPLIT.findall(t))
    vocab = [bytes([i]) for i in range(256)]
    ids = {t: i for i, t in enumerate(vocab)}
    while len(ids) < vocab_size - 1:
        pairs = Counter()
        for w, f in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += f
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], vocab[p[0]], vocab[p[1]]))
        tok = vocab[a] + vocab[b]
        if tok not in ids:
            ids[tok] = len(vocab)
            vocab.append(tok)
        words = Counter({tuple(bpe._merge(list(w), a, b, ids[tok])): f for w, f in words.items()})
    return ids


def test_training_is_deterministic_and_matches_reference():
    texts = SMALL * 3 + ["aaaaaaa bbbb aaab abab " * 5]
    ranks = bpe.train_bpe(texts, 400)
    assert ranks == bpe.train_bpe(list(texts), 400)
    assert ranks == _reference_bpe(texts, 400)
    assert sorted(ranks.values()) == list(range(len(ranks)))


def test_save_load_round_trip(tmp_path):
    ranks = bpe.train_bpe(SMALL * 5, 300)
    assert len(ranks) == 299
    path = tmp_path / "t.tiktoken"
    tokenizer.save_tokenizer(ranks, path)
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == ranks
    enc = tokenizer.load_tokenizer(path)
    assert enc.eot_token == 299 and enc.n_vocab == 300
    for tok, rank in ranks.items():
        assert enc.encode_single_token(tok) == rank
    assert tokenizer.encode(enc, f"foo{EOT}bar").count(299) == 1  # in-text EOT is the special token
    # rebuilding the file at the same path must not serve tiktoken's cached copy of the old one
    tokenizer.save_tokenizer(bpe.train_bpe(SMALL, 270), path)
    assert tokenizer.load_tokenizer(path).n_vocab == 270


def test_vocab_size_range():
    with pytest.raises(DataError):
        bpe.train_bpe(SMALL, 256)


def test_gpt2_offline_is_a_clear_error_or_works():
    try:
        assert tokenizer.get_encoding("gpt2").n_vocab == 50257
    except DataError as e:
        assert "default tokenizer, bpe" in str(e)


# -----------------------------------------------------------------------------
# prepare_data and val_prompts

def test_prepare_data_writes_reuses_and_rebuilds(small_build, capsys):
    folder, out, info = small_build
    names = ["tokenizer.tiktoken", "train.bin", "val.bin", "data_meta.json"]
    assert all((out / n).exists() for n in names) and not list(out.glob("*.tmp*"))
    assert info["vocab_size"] == 300 and info["eot_id"] == 299 and info["val_docs_count"] >= 1
    assert info["tokenizer_hash"] == bpe.file_sha256(out / "tokenizer.tiktoken")
    for split in ("train", "val"):
        ids = np.memmap(info[f"{split}_bin"], dtype=np.uint16, mode="r")
        assert len(ids) == info[f"n_{split}_tokens"] and ids[-1] == 299 and ids.max() < 300
    enc = tokenizer.get_encoding(info["tokenizer_path"])
    docs = tokenizer.decode(enc, np.fromfile(info["val_bin"], dtype=np.uint16)).split(EOT)[:-1]
    assert docs == data.load_documents(str(folder))[1]

    stamps = {n: os.stat(out / n).st_mtime_ns for n in names}
    assert data.prepare_data(out, str(folder), vocab_size=300) == info
    assert "reusing" in capsys.readouterr().out
    assert stamps == {n: os.stat(out / n).st_mtime_ns for n in names}

    data.prepare_data(out, str(folder), vocab_size=280)
    assert "because vocab_size changed" in capsys.readouterr().out
    (folder / "f00.py").write_text("x = 1\n" * 50)  # same folder, new contents
    new = data.prepare_data(out, str(folder), vocab_size=280)
    assert "because the data contents changed" in capsys.readouterr().out
    assert (new["n_train_tokens"] + new["n_val_tokens"]
            != info["n_train_tokens"] + info["n_val_tokens"])
    meta = json.loads((out / "data_meta.json").read_text())
    assert meta["fingerprint"] == data._fingerprint(str(folder))


def test_val_prompts(small_build):
    _, out, info = small_build
    prompts = prompt_sets.val_prompts(out, 5, 16)
    assert len(prompts) == 5 and all(len(p) == 16 for p in prompts)
    assert all(info["eot_id"] not in p for p in prompts)
    assert prompts == prompt_sets.val_prompts(out, 5, 16)
    assert prompts != prompt_sets.val_prompts(out, 5, 16, seed=1)
    with pytest.raises(DataError):
        prompt_sets.val_prompts(out, 1, 10**6)
