"""
tokenizer.py -- a byte-level BPE (byte-pair encoding) tokenizer: trained on the corpus
(train_bpe), kept in tiktoken's rank-file format, and encoding and decoding through tiktoken.

The split regex is written so that Python's `re` (training) and tiktoken's Rust engine
(encoding) cut text identically; the rank file is checked before tiktoken sees it (its core
crashes on a malformed one). training/data.py builds the token streams with it.
"""
import base64
import hashlib
import heapq
import pathlib
import re
import time
from collections import Counter, defaultdict

import tiktoken

from formats.hf_gpt2 import EOT  # noqa: F401 -- the end-of-text mark: GPT-2's, and ours
from runtime.command import atomic_write
from runtime.settings import DEFAULT_VOCAB

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

def file_sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


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


def encode(enc: tiktoken.Encoding, text: str) -> list[int]:
    return enc.encode(text, allowed_special={EOT})


def decode(enc: tiktoken.Encoding, ids) -> str:
    return enc.decode([int(i) for i in ids])
