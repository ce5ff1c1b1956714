"""
training/tokenizer.py -- a byte-level BPE (byte-pair encoding) tokenizer trained on the corpus
(train_bpe): its ranks, kept in tiktoken's rank-file format and encoded through tiktoken
(formats/tokenizer.py reads and writes them).

The split pattern (formats/tokenizer.py's PAT) is written so that Python's `re` (training here)
and tiktoken's Rust engine (encoding) cut text identically. training/data.py builds the token
streams with it.
"""
import hashlib
import heapq
import pathlib
import re
import time
from collections import Counter, defaultdict

from formats.tokenizer import PAT, DataError
from runtime.settings import DEFAULT_VOCAB

_SPLIT = re.compile(PAT)

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

def file_sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()
