"""
training/data.py -- the corpus, a tokenizer trained on it (training/tokenizer.py; formats/tokenizer.py
reads it back), and the token streams train.py reads (as random training windows: Batches). Every
command reads the build.

By default the corpus is the Python standard library that ships with the running interpreter
(no download needed); --data PATH swaps in a text file or a folder. prepare_data() writes four
files to out_dir and reuses them while they still match the data source, vocab size and
tokenizer kind:

    tokenizer.tiktoken   tiktoken's rank-file format ("base64(token) rank" per line), or
      or tokenizer.json  a Llama or Qwen folder's own, or a GGUF's (formats/pretrained.py)
    train.bin, val.bin   token ids, every document followed by the EOT (end-of-text) id: uint16,
                         or uint32 for a vocabulary beyond 65,536 (data_meta.json's token_bytes)
    data_meta.json       fingerprint, counts and each file's size and sha256, written last
                         (it marks a complete build, and vouches for the files)

Every reader checks the files against data_meta.json: prepare_data (train.py, this file's
command) rebuilds a damaged build with a one-line notice; load_build (bench.py, sample.py)
refuses it with an error naming the file and the command that remakes it. A trained target and
the build belong together by the tokenizer's hash, which the target records: load_build_for
refuses a pair that does not (the target would read ids it never saw), and a rebuild whose
tokenizer is not the target's is refused unless forced, whatever data_meta.json says.

    python -m training.data --help
"""

import hashlib
import json
import os
import pathlib
import shlex
import sys
import sysconfig
import time

import numpy as np
import torch

if not __package__:  # run by its path (python path/to/it.py): find the project as -m does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime.checkpoint import CheckpointError, load_checkpoint
from runtime.command import atomic_write, run
from runtime.settings import DEFAULT_VOCAB, ArgumentParser, number, path_arg
from formats.tokenizer import (EOT, PAT, DataError, HFTokenizer, get_encoding, load_tokenizer,
                               rank_file)
from training.tokenizer import file_sha256, train_bpe

FORMAT = 2  # bump when anything below changes what gets written, to invalidate old builds

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


def jsonl_lines(path, what: str) -> list[str]:
    """The lines of a user's JSONL file (a byte-order mark allowed); `what` names it in the one
    error line a file that is not UTF-8 gets (bench.py's --prompts, train.py's --gen-requests)."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            return f.readlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text (byte {e.start}): save it as UTF-8 "
                         "JSONL") from None


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
# prepare_data: build (or reuse) tokenizer + token streams in out_dir

_WHAT = {
    "format": "training/data.py's output format",
    "pattern": "the split regex",
    "source": "the data path",
    "fingerprint": "the data contents",
    "requested_vocab_size": "vocab_size",
    "tokenizer": "the tokenizer kind",
    "given_ranks": "the pretrained model's tokenizer",
}


def tokenizer_file(kind: str) -> str | None:
    """The file a build of this tokenizer kind keeps its tokenizer in (gpt2's is tiktoken's own)."""
    return {"gpt2": None, "hf": "tokenizer.json"}.get(kind, "tokenizer.tiktoken")


def token_dtype(meta: dict):
    """The token files' integer type: uint16 unless the build recorded 4 bytes a token."""
    return np.uint32 if meta.get("token_bytes") == 4 else np.uint16


def _result(out: pathlib.Path, meta: dict) -> dict:
    # paths are rebuilt from out_dir on every call, so a build stays usable from another cwd
    name = tokenizer_file(meta["tokenizer"])
    return {"tokenizer_path": str(out / name) if name else "gpt2", "kind": meta["tokenizer"],
            "token_dtype": np.dtype(token_dtype(meta)).name,  # "uint16" or "uint32"
            "pattern": meta.get("pattern", PAT),
            "tokenizer_hash": meta["tokenizer_hash"], "vocab_size": meta["vocab_size"],
            "train_bin": str(out / "train.bin"), "val_bin": str(out / "val.bin"),
            "eot_id": meta["eot_id"], "recipe": {k: meta.get(k) for k in RECIPE},
            **{k: meta[k] for k in ("n_train_tokens", "n_val_tokens", "val_docs_count")}}


# -----------------------------------------------------------------------------
# verifying a build: data_meta.json vouches for each file by its size and sha256

# what a build writes (one of the two tokenizer files, or neither)
BUILT = ("tokenizer.tiktoken", "tokenizer.json", "train.bin", "val.bin", "data_meta.json")
# tokenizer kinds: trained here (bpe), tiktoken's own GPT-2 (gpt2), the ranks of a pretrained
# GPT-2 folder (pretrained), or a Llama or Qwen folder's tokenizer.json (hf): train.py --init-from
KINDS = ("bpe", "gpt2", "pretrained", "hf")
FOLDER_KINDS = ("pretrained", "hf")  # the kinds a pretrained model gives (formats.tokenizer.Given.kind)
# how a build was made, as a target records it: enough for remake() to name the command that
# makes that build again
RECIPE = ("source", "tokenizer", "requested_vocab_size", "tokenizer_source")
_META_INTS = ("vocab_size", "eot_id", "n_train_tokens", "n_val_tokens", "val_docs_count")


def _expected(meta: dict) -> dict:
    """file name -> (bytes, sha256) it must have (a build without that record is damaged)."""
    return {name: (r["bytes"], r["sha256"]) for name, r in meta["files"].items()}


def read_meta(out: pathlib.Path) -> dict:
    """out/data_meta.json, checked for shape; a DataError naming it if it is missing or damaged."""
    path = pathlib.Path(out) / "data_meta.json"
    if not path.is_file():
        raise DataError(f"{path} is {'a folder (move it away)' if path.is_dir() else 'missing'}")
    try:
        meta = json.loads(path.read_bytes())
        files = _expected(meta)
        need = {"train.bin", "val.bin"} | ({tokenizer_file(meta["tokenizer"])} - {None})
        ok = (all(type(meta[k]) is int for k in _META_INTS)
              and meta["tokenizer"] in KINDS
              and need <= set(files)
              and all(type(n) is int and type(h) is str for n, h in files.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        # not JSON, not a dict, fields missing
        ok = False
    if not ok:
        raise DataError(f"{path} is damaged (not the JSON training/data.py writes)")
    return meta


def _damage(out: pathlib.Path, meta: dict) -> str | None:
    """What is wrong with the files meta describes, e.g. 'out/val.bin is 2,000 bytes, not
    37,134', or None."""
    for name, (size, sha) in _expected(meta).items():
        f = out / name
        if not f.is_file():
            return f"{f} is {'a folder (move it away)' if f.is_dir() else 'missing'}"
        if f.stat().st_size != size:
            return f"{f} is {f.stat().st_size:,} bytes, not {size:,} (truncated or damaged)"
        if file_sha256(f) != sha:
            return f"{f} does not match its sha256 in data_meta.json (modified or damaged)"
    return None


def remake(out: pathlib.Path, meta: dict | None = None) -> str:
    """The command that rebuilds out/'s data files, with the settings the build recorded (if
    known)."""
    if meta and meta.get("tokenizer") in FOLDER_KINDS:
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


def _wanted(data, vocab_size, tokenizer, given) -> dict:
    """What a build records of how it was made; one recording other values is rebuilt."""
    source = "stdlib" if data is None else str(pathlib.Path(data).expanduser().resolve())
    return {"format": FORMAT, "pattern": given.pattern if given else PAT, "source": source,
            "fingerprint": _fingerprint(data),
            "requested_vocab_size": vocab_size if tokenizer == "bpe" else None,
            "tokenizer": tokenizer, **({"given_ranks": given.fingerprint()} if given else {})}


def _changed(meta: dict, want: dict) -> list:
    """What a build records differently from what this one wants, e.g. ['the data path']."""
    return [_WHAT[k] for k in want if meta.get(k) != want[k]]


# -----------------------------------------------------------------------------
# a trained target and the build it reads: they belong together by their tokenizer


def trained_tokenizer(out: pathlib.Path) -> str | None:
    """The tokenizer hash out/target.pt was trained with; None where there is no target to keep
    (none, or one so damaged that train.py remakes it anyway). A target that records no tokenizer
    is kept as one whose tokenizer is unknown: ''."""
    path = pathlib.Path(out) / "target.pt"
    if not path.is_file():
        return None
    try:
        return load_checkpoint(str(path), "target").get("tokenizer_hash") or ""
    except CheckpointError:
        return None


def mismatch(target_ckpt: dict, build: dict, out_dir) -> str | None:
    """Why the target and the build in out_dir do not belong together, with the command that
    makes the target's build again (exactly, where the target recorded how it was made); None if
    they do."""
    had, now = target_ckpt.get("tokenizer_hash"), build["tokenizer_hash"]
    if had and had == now:
        return None
    out = pathlib.Path(out_dir)
    vocab = (target_ckpt.get("config") or {}).get("vocab_size", "?")
    why = (f"{out / 'target.pt'} was trained with tokenizer {str(had or 'unknown')[:12]} "
           f"({vocab} tokens) but the build in {out} holds tokenizer {now[:12]} "
           f"({build['vocab_size']} tokens)")
    return f"{why}; {remake(out, target_ckpt.get('data'))}"


def load_build_for(target_ckpt: dict, out_dir) -> dict:
    """load_build for a reader of the target too (bench.py, sample.py): a target and a build that
    do not belong together are refused before the first token, since the target would read ids
    it was never trained on."""
    build = load_build(out_dir)
    why = mismatch(target_ckpt, build, out_dir)
    if why:
        raise DataError(f"{why}, or retrain the target and its drafters on this build with "
                        f"`python train.py --out-dir {shlex.quote(str(out_dir))} --force`")
    return build


def _keep_trained(out: pathlib.Path, want: dict, trained: str | None, force: bool):
    """A rebuild for other data or another tokenizer would orphan out/target.pt (and every drafter
    trained on it): refused unless force, before the work, where the build it replaces is the
    target's. Where data_meta.json cannot say (missing or damaged), _keep_tokenizer decides by
    the tokenizer itself."""
    if trained is None or force:
        return
    try:
        meta = read_meta(out)
    except DataError:
        return
    changed = _changed(meta, want)
    if changed and meta["tokenizer_hash"] == trained:
        raise DataError(f"{out / 'target.pt'} was trained on the build in {out}, which "
                        f"{' and '.join(changed)} changing would replace: pass --force to "
                        "rebuild it and retrain every stage, or pick another --out-dir")


def _keep_tokenizer(out: pathlib.Path, tok_hash: str, trained: str | None, force: bool):
    """The tokenizer a rebuild made, before anything is written: one that is not the one
    out/target.pt was trained with is refused unless force, whatever data_meta.json says."""
    if trained is not None and tok_hash != trained and not force:
        raise DataError(f"{out / 'target.pt'} was trained with tokenizer "
                        f"{trained[:12] or 'unknown'}, and this build's would be {tok_hash[:12]}: "
                        "pass --force to rebuild the data and retrain every stage, or pick another "
                        "--out-dir")


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
    """given: for tokenizer 'pretrained' or 'hf', the model's tokenizer (formats.tokenizer.Given).
    force: rebuild even where a trained target would be left behind."""
    log = print if verbose else (lambda *a, **k: None)
    if tokenizer not in KINDS or (tokenizer in FOLDER_KINDS) != (given is not None):
        raise DataError(f"Unknown tokenizer {tokenizer!r}; use 'bpe' (trained here) or 'gpt2'.")
    out = pathlib.Path(out_dir)
    meta_path = out / "data_meta.json"
    tok_path = out / (tokenizer_file(tokenizer) or "none")
    if out.exists() and not out.is_dir():
        raise DataError(f"{out} is a file, not a folder; pick another --out-dir")
    blocked = [out / n for n in BUILT if (out / n).is_dir()]
    if blocked:  # writing over a folder would only fail at the end, half done
        raise DataError(f"{blocked[0]} is a folder where training/data.py writes a file; move it away or "
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
    trained = trained_tokenizer(out)
    _keep_trained(out, want, trained, force)
    log(f"data: {len(train_docs)} train / {len(val_docs)} val documents from {source}")
    if tokenizer == "gpt2":
        enc, tok_hash = get_encoding("gpt2"), "gpt2"
    elif given:
        ranks = given.ranks
    else:
        t0 = time.time()
        ranks = train_bpe(train_docs, vocab_size, verbose=verbose)
        log(f"data: trained a {len(ranks) + 1}-token BPE tokenizer in {time.time() - t0:.1f}s")
        if len(ranks) + 1 < vocab_size:
            log(f"data: the corpus only supports {len(ranks) + 1} tokens (asked for "
                f"{vocab_size}); using that")
    if tokenizer != "gpt2":  # the file's bytes, hashed before anything in out/ changes
        raw = given.json if tokenizer == "hf" else rank_file(ranks)
        tok_hash = hashlib.sha256(raw).hexdigest()
    _keep_tokenizer(out, tok_hash, trained, force)
    # only now, with the data read and checked, does out/ change; a half-finished rebuild
    # never looks complete: data_meta.json goes first and comes back last
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot make the folder {out} ({e.strerror}); "
                        "pick another --out-dir") from None
    meta_path.unlink(missing_ok=True)
    if tokenizer != "gpt2":
        atomic_write(tok_path, raw)
        enc = (HFTokenizer(tok_path, given.eot) if tokenizer == "hf"
               else load_tokenizer(tok_path, want["pattern"]))

    meta = {**want, "tokenizer_hash": tok_hash, "vocab_size": enc.n_vocab, "eot_id": enc.eot_token,
            "val_docs_count": len(val_docs),
            **({"tokenizer_source": given.folder} if given else {}),
            **({"token_bytes": 4} if enc.n_vocab > 1 << 16 else {})}
    for split, docs in (("train", train_docs), ("val", val_docs)):
        # every document is followed by EOT, so documents are separated (nanoGPT style)
        encoded = enc.encode_batch(docs, allowed_special={EOT})
        ids = [t for doc in encoded for t in (*doc, enc.eot_token)]
        atomic_write(out / f"{split}.bin", np.array(ids, dtype=token_dtype(meta)).tobytes())
        meta[f"n_{split}_tokens"] = len(ids)
    log(f"data: {meta['n_train_tokens']:,} train / {meta['n_val_tokens']:,} val tokens, "
        f"vocab {enc.n_vocab}")
    meta["files"] = {n: {"bytes": (out / n).stat().st_size, "sha256": file_sha256(out / n)}
                     for n in (tokenizer_file(tokenizer), "train.bin", "val.bin") if n}
    atomic_write(meta_path, json.dumps(meta, indent=2).encode())
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
        self.dtype = info["token_dtype"]
        self.T, self.B, self.seed = block_size, batch_size, seed
        self.rows = None

    def get(self, split, step, device, B=None):
        arr = np.memmap(self.files[split], dtype=self.dtype, mode="r")
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
    ap = ArgumentParser(prog="python -m training.data",
                        description="Prepare the tokenizer and token streams for nanospec.")
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
    run(main, errors=(DataError,),
        interrupted="a build is complete only once data_meta.json is written, last: the next run "
        "reuses a complete build and rebuilds an incomplete one")
