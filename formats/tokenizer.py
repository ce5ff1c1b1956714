"""
formats/tokenizer.py -- the tokenizers text goes through, behind the few methods of a
tiktoken.Encoding every command calls (encode, encode_batch, decode, eot_token, n_vocab):

    bpe          nanospec's own byte-level BPE (training/tokenizer.py trains it): a rank file,
                 "base64(token) rank" per line, encoded by tiktoken with the split pattern PAT
    gpt2         tiktoken's own GPT-2 encoding
    pretrained   a GPT-2 folder's vocab.json + merges.txt, as ranks (formats/hf_gpt2.py) with
                 GPT-2's split pattern
    hf           a tokenizer.json through the `tokenizers` package (HFTokenizer): a Llama or
                 Qwen folder's own, or one built from a GGUF's metadata (formats/gguf_vocab.py)

A data build keeps one of them beside its token files (training/data.py writes it); encoding_of
reads it back for every command that turns text into the target's ids. A pretrained model hands
its tokenizer on as a Given, which the build writes.
"""

import base64
import hashlib
import pathlib
from dataclasses import dataclass

import tiktoken

from runtime.checkpoint import CheckpointError
from runtime.command import atomic_write

EOT = "<|endoftext|>"  # the end-of-text mark: GPT-2's, and ours
# nanospec's split pattern, cl100k-style: words keep one leading space or symbol, numbers come in
# runs of <= 3 digits, symbol runs keep trailing newlines, and whitespace leaves its last space for
# the next word. It only uses explicit ASCII classes because it must split identically in Python's
# `re` (training) and tiktoken's Rust engine (encoding): the two disagree on what \s and \w mean
# for rare characters, and `re` has no \p{L}. Everything non-ASCII counts as a symbol. No English
# contraction rules: on code they would split 'self' into 's + elf.
_WS = r" \t\n\r\f\v"
PAT = (r"[^\r\nA-Za-z0-9]?[A-Za-z]+"
       r"|[0-9]{1,3}"
       rf"| ?[^{_WS}A-Za-z0-9]+[\r\n]*"
       rf"|[{_WS}]*[\r\n]+"
       rf"|[{_WS}]+(?![^{_WS}])"
       rf"|[{_WS}]+")


class DataError(ValueError):
    """A problem with the user's data or options, phrased so the user can fix it."""


@dataclass
class Given:
    """A pretrained model's tokenizer, for a data build: tiktoken ranks and their split pattern
    (a GPT-2 folder's vocab.json + merges.txt; kind 'pretrained'), or the text of a tokenizer.json
    and the id that ends a document (a Llama folder's own, or one built from a GGUF; kind 'hf')."""
    folder: str  # the source it came from
    ranks: dict | None = None
    pattern: str | None = None
    json: bytes | None = None
    eot: int | None = None
    n_vocab: int = 0  # its tokens, end-of-text included

    @property
    def kind(self):
        return "hf" if self.json is not None else "pretrained"

    def fingerprint(self):
        if self.json is None:
            h = hashlib.sha256()
            for t, r in sorted(self.ranks.items(), key=lambda kv: kv[1]):
                h.update(f"{r} {len(t)} ".encode() + t)
            return h.hexdigest()
        return f"{hashlib.sha256(self.json).hexdigest()} eot {self.eot}"


# -----------------------------------------------------------------------------
# rank files (bpe, pretrained): tiktoken's format


def rank_file(ranks: dict[bytes, int]) -> bytes:
    """The rank file's bytes (tiktoken's format), as save_tokenizer writes them."""
    return "".join(f"{base64.b64encode(t).decode()} {r}\n"
                   for t, r in sorted(ranks.items(), key=lambda kv: kv[1])).encode()


def save_tokenizer(ranks: dict[bytes, int], path):
    atomic_write(path, rank_file(ranks))


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


# -----------------------------------------------------------------------------
# tokenizer.json (hf): through the `tokenizers` package


class HFTokenizer:
    """A tokenizer.json as the few methods of a tiktoken.Encoding the project calls: encode,
    encode_batch, decode, eot_token, n_vocab, is_special_token, decode_single_token_bytes. Special
    tokens written in the text (the end-of-text mark) are encoded as themselves, as tiktoken does
    with allowed_special, and a text gets what the tokenizer's own post-processor adds to every
    text (Llama-3's and TinyLlama's begin-of-text token; Qwen's and SmolLM2's add nothing), as the
    model saw its training documents and as transformers' tokenizer encodes a prompt."""

    def __init__(self, path, eot_token, text=None):
        """path: a tokenizer.json, or with `text` (its content) what to call it in an error."""
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise CheckpointError(f"{path} needs the tokenizers package: pip install tokenizers") \
                from None
        try:
            self.tok = Tokenizer.from_str(text) if text else Tokenizer.from_file(str(path))
        except Exception as e:  # the package raises its own exception type for bad files
            raise CheckpointError(f"{path} is not a tokenizer the tokenizers package reads "
                                  f"({str(e).splitlines()[0][:160]})") from None
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = eot_token
        self.special = {t.content for t in self.tok.get_added_tokens_decoder().values()
                        if t.special}

    def encode(self, text, allowed_special=()):
        return self.tok.encode(text).ids

    def encode_plain(self, text):
        """The ids of `text` alone, nothing added around it (a chat template writes its own)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts, allowed_special=()):
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def is_special_token(self, t):
        return self.tok.id_to_token(t) in self.special

    def decode_single_token_bytes(self, t):
        # a token that is part of a character decodes to U+FFFD here, not to its bytes: enough
        # for what reads it (benchmark/prompt_sets.py: which tokens end a line)
        return self.decode([t]).encode("utf-8")


# -----------------------------------------------------------------------------
# a data build's tokenizer, and text <-> ids


def encoding_of(info: dict):
    """The tokenizer of a data build (training/data.py's prepare_data or load_build result: its
    kind, its file; gpt2's has none)."""
    path = info["tokenizer_path"]
    if info.get("kind") == "hf":
        return HFTokenizer(path, info["eot_id"])
    return get_encoding("gpt2") if path == "gpt2" else load_tokenizer(path, info["pattern"])


def encode(enc, text: str) -> list[int]:
    return enc.encode(text, allowed_special={EOT})


def decode(enc, ids) -> str:
    return enc.decode([int(i) for i in ids])
