"""
data.py -- the corpus, a byte-level BPE (byte-pair encoding) tokenizer trained on it, and the
token streams train.py reads (as random training windows: Batches). Every other file uses it.

By default the corpus is the Python standard library that ships with the running interpreter
(no download needed); --data PATH swaps in a text file or a folder. prepare_data() writes four
files to out_dir and reuses them while they still match the data source, vocab size and
tokenizer kind:

    tokenizer.tiktoken   tiktoken's rank-file format ("base64(token) rank" per line)
    train.bin, val.bin   uint16 token ids, every document followed by the EOT (end-of-text) id
    data_meta.json       fingerprint, counts and each file's size and sha256, written last
                         (it marks a complete build, and vouches for the files)

Every reader checks the files against data_meta.json: prepare_data (train.py, data.py)
rebuilds a damaged build with a one-line notice; load_build (bench.py, sample.py) refuses
it with an error naming the file and the command that remakes it. CLI: `python -m training.data --help`.
"""
import base64
import hashlib
import heapq
import json
import os
import pathlib
import re
import shlex
import sysconfig
import time
from collections import Counter, defaultdict

import numpy as np
import tiktoken
import torch

from runtime.settings import DEFAULT_VOCAB, ArgumentParser, number, path_arg

EOT = "<|endoftext|>"
FORMAT = 2  # bump when anything below changes what gets written, to invalidate old builds

# Pre-tokenisation regex, cl100k-style: words keep one leading space or symbol, numbers
# come in runs of <= 3 digits, symbol runs keep trailing newlines, and whitespace leaves
# its last space for the next word. It only uses explicit ASCII classes because it must
# split identically in Python's `re` (training) and tiktoken's Rust engine (encoding):
# the two disagree on what \s and \w mean for rare characters, and `re` has no \p{L}.
# Everything non-ASCII counts as a symbol. No English contraction rules: on code they
# would split 'self' into 's + elf.
_WS = r" \t\n\r\f\v"
PAT = (r"[^\r\nA-Za-z0-9]?[A-Za-z]+"
       r"|[0-9]{1,3}"
       rf"| ?[^{_WS}A-Za-z0-9]+[\r\n]*"
       rf"|[{_WS}]*[\r\n]+"
       rf"|[{_WS}]+(?![^{_WS}])"
       rf"|[{_WS}]+")
_SPLIT = re.compile(PAT)


class DataError(ValueError):
    """A problem with the user's data or options, phrased so the user can fix it."""


# -----------------------------------------------------------------------------
# corpus: which files, read as documents, split into train/val by file

def stdlib_files() -> list[pathlib.Path]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    return sorted(p for p in root.rglob("*.py")
                  if not any(d in skip or d.startswith("test_")
                             for d in p.relative_to(root).parts[:-1]))


def _source(data: str | None) -> tuple[pathlib.Path, list[pathlib.Path]]:
    """(root, sorted files) for a data source; document names are paths relative to root."""
    if data is None:
        return pathlib.Path(sysconfig.get_paths()["stdlib"]), stdlib_files()
    path = pathlib.Path(data).expanduser()
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():  # hidden files and folders (.git, .venv, ...) are not part of a corpus
        return path, sorted(p for p in path.rglob("*") if p.is_file()
                            and not any(c.startswith(".") for c in p.relative_to(path).parts))
    if path.exists():  # a device, a socket, a pipe: nothing to rglob or re-read
        raise DataError(f"Data path {str(path)!r} is neither a file nor a folder; pass a text file "
                        "or folder with --data.")
    raise DataError(f"Data path {str(path)!r} does not exist; pass an existing text file or folder "
                    "with --data.")


def _read_text(path: pathlib.Path) -> str | None:
    """The file's text, or None if it is not UTF-8 text (NUL bytes count as binary)."""
    raw = path.read_bytes()
    try:
        return None if b"\0" in raw else raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def load_documents(data: str | None = None) -> tuple[list[str], list[str]]:
    """(train_docs, val_docs); about 5% of the documents go to validation."""
    root, files = _source(data)
    single = data is not None and pathlib.Path(data).expanduser().is_file()
    docs = {}  # name -> text, in sorted file order
    for f in files:
        text = _read_text(f)
        if text is None and single:
            raise DataError(f"{str(f)!r} is not UTF-8 text (binary or another encoding); pass a "
                            "UTF-8 text file.")
        if text and text.strip():
            docs[f.relative_to(root).as_posix()] = text
    if not docs:
        what = f"{'file' if single else 'folder'} {str(data or root)!r}"
        if single or not files:
            raise DataError(f"The data {what} is empty; point --data at a file or folder with text "
                            "in it.")
        raise DataError(f"The data {what} has {len(files)} files but none is non-empty UTF-8 text; "
                        "point --data at UTF-8 text files.")
    if len(docs) == 1:
        # one document cannot be split by file: cut it into ~20 parts at line boundaries instead
        (name, text), = docs.items()
        lines, target, docs, part = text.splitlines(keepends=True), len(text) / 20, {}, ""
        for line in lines:
            part += line
            if len(part) >= target:
                docs[f"{name}:{len(docs):02d}"], part = part, ""
        if part:
            docs[f"{name}:{len(docs):02d}"] = part
        if len(docs) < 2:
            raise DataError(f"{name!r} is a single line, too little to split into train and "
                            "validation; give more lines or more files.")
    # validation = documents whose name hashes to 0 mod 20: a stable rule, so adding or removing
    # other files never moves a document between splits; at least one document in each split
    names = list(docs)
    val = ([n for n in names if int(hashlib.sha256(n.encode()).hexdigest(), 16) % 20 == 0]
           or names[-1:])
    val = set(val[1:] if len(val) == len(names) else val)
    return [docs[n] for n in names if n not in val], [docs[n] for n in names if n in val]


def _fingerprint(data: str | None) -> str:
    """sha256 over sorted relative file names and contents: changes iff the corpus changes."""
    root, files = _source(data)
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# byte-level BPE training, with incremental pair counts

def _merge(word: list[int], a: int, b: int, new: int) -> list[int]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(texts: list[str], vocab_size: int = DEFAULT_VOCAB, verbose=False) -> dict[bytes, int]:
    """Mergeable ranks: the 256 bytes, then merges in learned order (vocab_size counts EOT too)."""
    if not 257 <= vocab_size <= 65536:
        raise DataError(f"vocab_size {vocab_size} is out of range; use 257..65536 "
                        "(256 bytes + EOT at least, and ids must fit in uint16).")
    t0 = time.time()
    # regex chunks never merge across each other, so BPE only needs each unique chunk once, with
    # its count
    chunks = Counter(c for text in texts for c in _SPLIT.findall(text))
    words = [list(c.encode("utf-8")) for c in chunks]
    freqs = list(chunks.values())
    vocab = [bytes([i]) for i in range(256)]  # token id -> bytes; the id is the rank
    ids = {t: i for i, t in enumerate(vocab)}
    counts = defaultdict(int)  # pair -> occurrences in the corpus
    where = defaultdict(set)  # pair -> ids of words that (may) contain it
    for w, (word, f) in enumerate(zip(words, freqs)):
        for p in zip(word, word[1:]):
            counts[p] += f
            where[p].add(w)
    # max-heap with lazy deletion: entries whose count is out of date get skipped when popped.
    # Ties go to the smallest (left bytes, right bytes), so training is deterministic.
    heap = [(-c, vocab[a], vocab[b], a, b) for (a, b), c in counts.items()]
    heapq.heapify(heap)
    while len(ids) < vocab_size - 1 and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        if counts.get((a, b)) != -negc:
            continue
        tok = vocab[a] + vocab[b]
        if tok not in ids:  # (two merge paths can spell the same bytes: reuse that token)
            ids[tok] = len(vocab)
            vocab.append(tok)
        new = ids[tok]
        delta = defaultdict(int)
        for w in where.pop((a, b)):
            word, f = words[w], freqs[w]
            merged = _merge(word, a, b, new)
            if len(merged) == len(word):
                continue  # stale entry: an earlier merge already consumed the pair here
            for p in zip(word, word[1:]):
                delta[p] -= f
            for p in zip(merged, merged[1:]):
                delta[p] += f
                where[p].add(w)
            words[w] = merged
        for p, d in delta.items():
            if d:
                counts[p] += d
                if counts[p] > 0:
                    heapq.heappush(heap, (-counts[p], vocab[p[0]], vocab[p[1]], *p))
                else:
                    del counts[p]
        if verbose and len(ids) % 512 == 0:
            print(f"bpe: {len(ids)}/{vocab_size - 1} tokens, last {tok!r} x{-negc}, "
                  f"{time.time() - t0:.1f}s")
    return ids


# -----------------------------------------------------------------------------
# tokenizer files and encoding helpers

def _atomic_write(path, data: bytes):
    tmp = f"{path}.tmp{os.getpid()}"  # same folder, so os.replace is an atomic rename
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ranks_hash(ranks: dict[bytes, int]) -> str:
    h = hashlib.sha256()
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        h.update(f"{r} {len(t)} ".encode() + t)
    return h.hexdigest()


def file_sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def save_tokenizer(ranks: dict[bytes, int], path):
    lines = (f"{base64.b64encode(t).decode()} {r}\n"
             for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    _atomic_write(path, "".join(lines).encode())


def read_ranks(path) -> dict[bytes, int]:
    """The rank file at path (tiktoken's format), checked: tiktoken's Rust core *panics* -- a
    crash, not an exception -- on ranks with gaps or repeats or without all 256 bytes, so those
    stop here."""
    try:
        lines = pathlib.Path(path).read_bytes().splitlines()
    except OSError as e:
        raise DataError(f"cannot read the tokenizer {path} ({e.strerror})") from None
    ranks = {}
    for i, line in enumerate(lines, 1):
        try:
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # incl. binascii.Error
            raise DataError(
                f"{path} line {i} is not 'base64-token rank': not a tokenizer file") from None
    if (sorted(ranks.values()) != list(range(len(ranks)))
            or any(bytes([b]) not in ranks for b in range(256))):
        raise DataError(f"{path} is not a byte-level BPE tokenizer (ranks must be 0..n-1 and cover "
                        "all 256 bytes)")
    return ranks


def load_tokenizer(path, pattern=PAT) -> tiktoken.Encoding:
    """A rank file as an Encoding: nanospec's split pattern, or a pretrained model's (GPT-2's)."""
    # read here, not with tiktoken.load: that caches files by *path* and would serve a stale copy
    return encoding_from(read_ranks(path), pattern)


def encoding_from(ranks: dict[bytes, int], pattern=PAT) -> tiktoken.Encoding:
    """Mergeable ranks and a split pattern as an Encoding, end-of-text right after the ranks."""
    return tiktoken.Encoding(name="nanospec", pat_str=pattern, mergeable_ranks=ranks,
                             special_tokens={EOT: len(ranks)})


def get_encoding(tokenizer_path_or_kind) -> tiktoken.Encoding:
    """'gpt2', or a tokenizer file. (A build's tokenizer, checked against its data_meta.json, is
    encoding_of(load_build(out_dir)).)"""
    if str(tokenizer_path_or_kind) != "gpt2":
        return load_tokenizer(tokenizer_path_or_kind)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline, tiktoken cannot download the GPT-2 ranks
        raise DataError(f"tiktoken could not load the GPT-2 tokenizer ({type(e).__name__}), "
                        "probably because it is not cached and there is no internet; use the "
                        "default tokenizer, bpe.") from e


def encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    return enc.encode(text, allowed_special={EOT})


def decode(enc: tiktoken.Encoding, ids) -> str:
    return enc.decode([int(i) for i in ids])


# -----------------------------------------------------------------------------
# prepare_data: build (or reuse) tokenizer + token streams in out_dir

_WHAT = {
    "format": "data.py's output format",
    "pattern": "the split regex",
    "source": "the data path",
    "fingerprint": "the data contents",
    "requested_vocab_size": "vocab_size",
    "tokenizer": "the tokenizer kind",
    "given_ranks": "the pretrained model's tokenizer",
}


def _result(out: pathlib.Path, meta: dict) -> dict:
    # paths are rebuilt from out_dir on every call, so a build stays usable from another cwd
    has_file = meta["tokenizer"] != "gpt2"
    return {"tokenizer_path": str(out / "tokenizer.tiktoken") if has_file else "gpt2",
            "pattern": meta.get("pattern", PAT),
            "tokenizer_hash": meta["tokenizer_hash"], "vocab_size": meta["vocab_size"],
            "train_bin": str(out / "train.bin"), "val_bin": str(out / "val.bin"),
            "eot_id": meta["eot_id"],
            **{k: meta[k] for k in ("n_train_tokens", "n_val_tokens", "val_docs_count")}}


# -----------------------------------------------------------------------------
# verifying a build: data_meta.json vouches for each file by its size and sha256

BUILT = ("tokenizer.tiktoken", "train.bin", "val.bin", "data_meta.json")  # what a build writes
# tokenizer kinds: trained here (bpe), tiktoken's own GPT-2 (gpt2), or the ranks of a pretrained
# model's folder (pretrained: train.py --init-from; pretrained.py reads them)
KINDS = ("bpe", "gpt2", "pretrained")
_META_INTS = ("vocab_size", "eot_id", "n_train_tokens", "n_val_tokens", "val_docs_count")


def _expected(meta: dict) -> dict:
    """file name -> (bytes, sha256) it must have. Builds before format 2 recorded only the token
    counts and the tokenizer's hash: those are checked (bench.py can still read such a build)."""
    if "files" in meta:
        return {name: (r["bytes"], r["sha256"]) for name, r in meta["files"].items()}
    files = {f"{s}.bin": (2 * meta[f"n_{s}_tokens"], None) for s in ("train", "val")}
    if meta["tokenizer"] == "bpe":
        files["tokenizer.tiktoken"] = (None, meta["tokenizer_hash"])
    return files


def read_meta(out: pathlib.Path) -> dict:
    """out/data_meta.json, checked for shape; a DataError naming it if it is missing or damaged."""
    path = pathlib.Path(out) / "data_meta.json"
    if not path.is_file():
        raise DataError(f"{path} is {'a folder (move it away)' if path.is_dir() else 'missing'}")
    try:
        meta = json.loads(path.read_bytes())
        files = _expected(meta)
        tokenizer_file = {"tokenizer.tiktoken"} if meta["tokenizer"] != "gpt2" else set()
        need = {"train.bin", "val.bin"} | tokenizer_file
        ok = (all(type(meta[k]) is int for k in _META_INTS)
              and meta["tokenizer"] in KINDS
              and need <= set(files)
              and all(type(n) in (int, type(None)) and type(h) in (str, type(None))
                      for n, h in files.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        # not JSON, not a dict, fields missing
        ok = False
    if not ok:
        raise DataError(f"{path} is damaged (not the JSON data.py writes)")
    return meta


def _damage(out: pathlib.Path, meta: dict) -> str | None:
    """What is wrong with the files meta describes, e.g. 'out/val.bin is 2,000 bytes, not
    37,134', or None."""
    for name, (size, sha) in _expected(meta).items():
        f = out / name
        if not f.is_file():
            return f"{f} is {'a folder (move it away)' if f.is_dir() else 'missing'}"
        if size is not None and f.stat().st_size != size:
            return f"{f} is {f.stat().st_size:,} bytes, not {size:,} (truncated or damaged)"
        if sha is not None and file_sha256(f) != sha:
            return f"{f} does not match its sha256 in data_meta.json (modified or damaged)"
    return None


def remake(out: pathlib.Path, meta: dict | None = None) -> str:
    """The command that rebuilds out/'s data files, with the settings the build recorded (if
    known)."""
    if meta and meta.get("tokenizer") == "pretrained":
        return (f"rebuild it with `python train.py --init-from "
                f"{shlex.quote(meta.get('tokenizer_source', 'DIR'))} --out-dir "
                f"{shlex.quote(str(out))}`, passing the --data it was built with")
    if not meta or "source" not in meta:
        return (f"rebuild it with `python -m training.data --out-dir {shlex.quote(str(out))}` "
                "(or `python train.py`), passing the --data and --vocab-size it was built with")
    data = ["--data", meta["source"]] if meta["source"] != "stdlib" else []
    flags = ["--out-dir", str(out)] + data
    flags += (["--tokenizer", "gpt2"] if meta["tokenizer"] == "gpt2"
              else ["--vocab-size", str(meta["requested_vocab_size"])])
    return (f"rebuild it with `python -m training.data {shlex.join(flags)}` "
            "(train.py with the same flags rebuilds it too)")


def load_build(out_dir) -> dict:
    """The build in out_dir for a command that only reads it (bench.py, sample.py): every file
    checked against data_meta.json, a damaged one a DataError naming the command to remake it."""
    out = pathlib.Path(out_dir)
    try:
        meta = read_meta(out)
    except DataError as e:
        raise DataError(f"{e}: {remake(out)}") from None
    problem = _damage(out, meta)
    if problem:
        raise DataError(f"{problem}: {remake(out, meta)}")
    return _result(out, meta)


def encoding_of(info: dict) -> tiktoken.Encoding:
    """The tokenizer of a build (prepare_data's or load_build's result; gpt2's has no file)."""
    path = info["tokenizer_path"]
    return get_encoding("gpt2") if path == "gpt2" else load_tokenizer(path, info["pattern"])


def _wanted(data, vocab_size, tokenizer, given) -> dict:
    """What a build records of how it was made; one recording other values is rebuilt."""
    source = "stdlib" if data is None else str(pathlib.Path(data).expanduser().resolve())
    return {"format": FORMAT, "pattern": given[1] if given else PAT, "source": source,
            "fingerprint": _fingerprint(data),
            "requested_vocab_size": vocab_size if tokenizer == "bpe" else None,
            "tokenizer": tokenizer, **({"given_ranks": ranks_hash(given[0])} if given else {})}


def _changed(meta: dict, want: dict) -> list:
    """What a build records differently from what this one wants, e.g. ['the data path']."""
    return [_WHAT[k] for k in want if meta.get(k) != want[k]]


def _keep_trained(out: pathlib.Path, want: dict, force: bool):
    """A rebuild for other data or another tokenizer would orphan out/target.pt (and every drafter
    trained on it): refused unless force. A damaged build is rebuilt byte for byte: no change."""
    try:
        changed = _changed(read_meta(out), want)
    except DataError:
        return
    if changed and not force and (out / "target.pt").exists():
        raise DataError(f"{out / 'target.pt'} was trained on the build in {out}, which "
                        f"{' and '.join(changed)} changing would replace: pass --force to "
                        "rebuild it and retrain every stage, or pick another --out-dir")


def _reusable(out: pathlib.Path, want: dict, log) -> dict | None:
    """The meta of an earlier build of the same data and settings whose files are intact; else None,
    after a one-line notice of why it is rebuilt."""
    if not (out / "data_meta.json").exists():
        if any((out / n).exists() for n in BUILT):
            log(f"data: rebuilding {out}/ because {out / 'data_meta.json'} is missing")
        return None
    try:
        meta = read_meta(out)
    except DataError as e:
        log(f"data: rebuilding {out}/ because {e}")
        return None
    changed = _changed(meta, want)
    why = " and ".join(changed) + " changed" if changed else _damage(out, meta)
    if why is None:
        return meta
    log(f"data: rebuilding {out}/ because {why}")
    return None


def prepare_data(out_dir="out", data=None, vocab_size=DEFAULT_VOCAB, tokenizer="bpe",
                 verbose=True, given=None, force=False) -> dict:
    """given: for tokenizer 'pretrained', (mergeable ranks, split pattern, their folder).
    force: rebuild even where a trained target would be left behind."""
    log = print if verbose else (lambda *a, **k: None)
    if tokenizer not in KINDS or (tokenizer == "pretrained") != (given is not None):
        raise DataError(f"Unknown tokenizer {tokenizer!r}; use 'bpe' (trained here) or 'gpt2'.")
    out = pathlib.Path(out_dir)
    meta_path, tok_path = out / "data_meta.json", out / "tokenizer.tiktoken"
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a folder; pick another --out-dir")
    blocked = [out / n for n in BUILT if (out / n).is_dir()]
    if blocked:  # writing over a folder would only fail at the end, half done
        raise DataError(f"{blocked[0]} is a folder where data.py writes a file; move it away or "
                        "pick another --out-dir")
    want = _wanted(data, vocab_size, tokenizer, given)
    source = want["source"]

    # fast path: a complete previous build of the same data with the same settings, files intact
    meta = _reusable(out, want, log)
    if meta is not None:
        log(f"data: reusing {out}/ ({meta['n_train_tokens']:,} train / "
            f"{meta['n_val_tokens']:,} val tokens)")
        return _result(out, meta)

    train_docs, val_docs = load_documents(data)
    _keep_trained(out, want, force)
    log(f"data: {len(train_docs)} train / {len(val_docs)} val documents from {source}")
    if tokenizer == "gpt2":
        enc, tok_hash = get_encoding("gpt2"), "gpt2"
    elif given:
        ranks = given[0]
    else:
        t0 = time.time()
        ranks = train_bpe(train_docs, vocab_size, verbose=verbose)
        log(f"data: trained a {len(ranks) + 1}-token BPE tokenizer in {time.time() - t0:.1f}s")
        if len(ranks) + 1 < vocab_size:
            log(f"data: the corpus only supports {len(ranks) + 1} tokens (asked for "
                f"{vocab_size}); using that")
    # only now, with the data read and checked, does out/ change; a half-finished rebuild
    # never looks complete: data_meta.json goes first and comes back last
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot make the folder {out} ({e.strerror}); "
                        "pick another --out-dir") from None
    meta_path.unlink(missing_ok=True)
    if tokenizer != "gpt2":
        save_tokenizer(ranks, tok_path)
        enc, tok_hash = load_tokenizer(tok_path, want["pattern"]), file_sha256(tok_path)

    meta = {**want, "tokenizer_hash": tok_hash, "vocab_size": enc.n_vocab, "eot_id": enc.eot_token,
            "val_docs_count": len(val_docs), **({"tokenizer_source": given[2]} if given else {})}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        # every document is followed by EOT, so documents are separated (nanoGPT style)
        encoded = enc.encode_batch(docs, allowed_special={EOT})
        ids = [t for doc in encoded for t in (*doc, enc.eot_token)]
        _atomic_write(out / f"{split}.bin", np.array(ids, dtype=np.uint16).tobytes())
        meta[f"n_{split}_tokens"] = len(ids)
    log(f"data: {meta['n_train_tokens']:,} train / {meta['n_val_tokens']:,} val tokens, "
        f"vocab {enc.n_vocab}")
    meta["files"] = {n: {"bytes": (out / n).stat().st_size, "sha256": file_sha256(out / n)}
                     for n in BUILT[:3] if n != "tokenizer.tiktoken" or tokenizer != "gpt2"}
    _atomic_write(meta_path, json.dumps(meta, indent=2).encode())
    return _result(out, meta)


# -----------------------------------------------------------------------------
# training batches: random windows of the token files (train.py)


class Batches:
    """Random windows of the corpus's token files. The window offsets of step s come from a
    generator seeded with (seed, s): training is reproducible and a resumed run replays exactly.
    rows: a slice of each batch_size batch to return instead of all of it (train.py sets it to
    this process's shard of a micro-step, ddp.shard), so every shard is cut from the same batch."""

    def __init__(self, info, block_size, batch_size, seed):
        self.files = {"train": info["train_bin"], "val": info["val_bin"]}
        self.T, self.B, self.seed = block_size, batch_size, seed
        self.rows = None

    def get(self, split, step, device, B=None):
        arr = np.memmap(self.files[split], dtype=np.uint16, mode="r")
        if len(arr) <= self.T + 1:
            raise DataError(f"the {split} split has only {len(arr)} tokens; it needs more than "
                            f"{self.T + 1}: use more data or a smaller --block-size")
        offset = 0 if split == "train" else 7_919_000
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step + offset)
        ix = torch.randint(len(arr) - self.T - 1, (B or self.B,), generator=g).tolist()
        if B is None and self.rows is not None:
            ix = ix[self.rows]
        x = torch.stack([torch.from_numpy(arr[i:i + self.T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(arr[i + 1:i + 1 + self.T].astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)


# -----------------------------------------------------------------------------

def build_parser():
    ap = ArgumentParser(prog="python -m training.data", description="Prepare the tokenizer and token streams for nanospec.")
    ap.add_argument("--data", type=path_arg("data"), default=None,
                    help="text file or folder to train on (default: the Python stdlib)")
    ap.add_argument("--vocab-size", type=number(int, 257, 65536), default=DEFAULT_VOCAB,
                    help="tokenizer vocab size, EOT included (default: %(default)s)")
    ap.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2"],
                    help="train a BPE here, or use GPT-2's (default: %(default)s)")
    ap.add_argument("--out-dir", type=path_arg("dir"), default="out",
                    help="where tokenizer.tiktoken, train.bin, val.bin and data_meta.json are "
                         "written (default: %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="rebuild even where out/target.pt was trained on the build it replaces "
                    "(default: refuse)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    info = prepare_data(args.out_dir, args.data, args.vocab_size, args.tokenizer, force=args.force)
    print(json.dumps(info, indent=2))
    return info


if __name__ == "__main__":
    try:
        main()
    except DataError as e:
        raise SystemExit(f"error: {e}")
