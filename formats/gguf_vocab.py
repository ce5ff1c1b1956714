"""
formats/gguf_vocab.py -- a GGUF's tokenizer (its tokenizer.ggml.* metadata) as a tokenizer.json, the
file the `tokenizers` package reads (formats/tokenizer.py's HFTokenizer), built as transformers
builds it from the same file, so that both give the same ids.

Two kinds of tokenizer live in the GGUFs llama.py reads (tokenizer.ggml.model):

    gpt2    byte-level BPE (SmolLM2, Llama 3, Qwen2, Qwen2.5, Qwen3): every byte spelled as one
            printable character (GPT-2's table), the text cut into pieces by a regular expression
            (tokenizer.ggml.pre names which: Llama 3's, Qwen2's, or GPT-2's own), then the merges
            (tokenizer.ggml.merges, "left right", in rank order) applied inside each piece
    llama   SentencePiece's BPE (Llama 2, TinyLlama): a space is "▁" and one goes before the
            text, pairs merged by the score of what they make (tokenizer.ggml.scores), a character
            the vocabulary lacks spelled as its bytes (<0xE6><0x97><0xA5>)

Control tokens (tokenizer.ggml.token_type 3: <|im_start|>, <|im_end|>, <s>) and the named ones
(bos, eos, unknown, padding) are special: written in a text they are encoded as themselves, never
split; user-defined ones (type 4) likewise, as plain tokens. A text gets a begin-of-sequence token
in front where tokenizer.ggml.add_bos_token says so (a SentencePiece model's default).

Where transformers and llama.cpp disagree this follows transformers, the peer the tests compare
with: SmolLM2's "smollm" pre-tokenizer is GPT-2's pattern (llama.cpp keeps digits apart, which
gives the same ids on SmolLM2's vocabulary, which has no multi-digit tokens). Unlike transformers,
no "<|endoftext|>" is added to a vocabulary that lacks it (Llama 3's): it would be an id the
model's embedding has no row for.
"""

import json
import os

from formats.tokenizer import Given, HFTokenizer
from runtime.checkpoint import CheckpointError

try:  # optional: the tokenizer of a GGUF (or a Llama folder's tokenizer.json) needs it
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
except ImportError:
    tokenizers = None

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (gguf.TokenType)
# tokenizer.ggml.pre -> the pattern that cuts a text into pieces before the merges (None: GPT-2's
# own, the byte-level pre-tokenizer's default); a name not listed is refused, not guessed
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # one digit a piece
SPLITS = {"default": None, "gpt-2": None, "gpt2": None, "smollm": None,
          "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "llama-bpe": LLAMA3_SPLIT,
          "smaug-bpe": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT,
          "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT}


def byte_spelling():
    """GPT-2's printable character for each byte (the spelling of a byte-level BPE's tokens)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
             *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in shown]
    return {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def sentencepiece_merges(tokens, scores):
    """The merges of a SentencePiece BPE, which keeps only each token's score: every way a token
    splits into two tokens, the best-scored product first (then by the pieces' lengths; as
    transformers derives them)."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        splits = [(token[:i], token[i:], score) for i in range(1, len(token))
                  if token[:i] in ids and token[i:] in ids]
        merges += sorted(splits, key=lambda m: (ids[m[0]], ids[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def tokenizer_of(f):
    """A GGUF's tokenizer (f: formats/gguf.py's File) as a data build keeps it, a Given: the
    tokenizer.json built from its metadata, and the id its eos names, which ends a document."""
    v = f.vocab
    eot = v.get("eos_token_id")
    if not isinstance(eot, int) or not 0 <= eot < len(v.get("tokens") or []):
        raise CheckpointError(f"{f.path} is not a GGUF file train.py can use: its "
                              f"tokenizer.ggml.eos_token_id {eot!r} is not one of its tokens")
    text = tokenizer_json(v, f.path)
    return Given(os.path.abspath(f.path), json=text.encode(), eot=eot,
                 n_vocab=HFTokenizer(f.path, eot, text).n_vocab)


def chat_tokens(v):
    """What a chat template needs of a GGUF's tokenizer metadata `v`: (its named tokens' texts,
    {bos_token: "<s>", ...}, and the ids that end a turn: its eos, eot and eom)."""
    names = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
             "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
    tokens = {n: v["tokens"][v[k]] for n, k in names.items()
              if k in v and 0 <= v[k] < len(v["tokens"])}
    return tokens, [v[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if k in v]


def tokenizer_json(v, where):
    """The tokenizer.json of a GGUF's tokenizer metadata `v` ({key after tokenizer.ggml.: value}):
    a string. `where` names the file in an error line."""
    if tokenizers is None:
        raise CheckpointError(f"{where}'s tokenizer needs the tokenizers package: pip install "
                              "tokenizers")
    try:
        return built(v, where)
    except CheckpointError:
        raise
    except Exception as e:  # the package's own error: a merge of tokens it does not hold, ...
        first = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{where}'s tokenizer does not build ({first}): a damaged "
                              "file") from None


def built(v, where):
    """tokenizer_json's work, its errors left to it."""
    kind, tokens = v.get("model"), v.get("tokens") or []
    if kind == "gpt2":
        tok, add_bos, specials = byte_level(v, where), v.get("add_bos_token", False), []
    elif kind == "llama":  # SentencePiece's own specials, wherever the vocabulary has them
        tok, add_bos, specials = sentencepiece(v), v.get("add_bos_token", True), \
            ["<s>", "</s>", "<unk>"]
    else:
        raise CheckpointError(f"{where}'s tokenizer is {kind!r}; train.py reads 'gpt2' (byte-level "
                              "BPE) and 'llama' (SentencePiece) tokenizers")
    types = v.get("token_type") or [1] * len(tokens)
    spelled = byte_spelling().values() if kind == "gpt2" else None
    control = [t for t, ty in zip(tokens, types) if ty == CONTROL
               and (spelled is None or set(t) <= set(spelled))]
    named = [tokens[i] for i in (v.get(k) for k in ("bos_token_id", "eos_token_id",
                                                    "unknown_token_id", "padding_token_id"))
             if isinstance(i, int) and 0 <= i < len(tokens)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in [*[s for s in specials if s in tokens], *control, *named]])
    known = tok.get_vocab(with_added_tokens=True)  # a re-spelled one is not found: not added
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in known])
    tok.post_processor = template(tokens, v, add_bos, v.get("add_eos_token", False))
    return tok.to_str()


def byte_level(v, where):
    """A byte-level BPE of the GPT-2 kind: the tokens as GPT-2 spells them, the merges, the
    pre-tokenizer `tokenizer.ggml.pre` names."""
    pre = v.get("pre", "default")
    if pre not in SPLITS:
        raise CheckpointError(f"{where}'s pre-tokenizer is {pre!r}, which train.py does not know "
                              f"(it knows {', '.join(sorted(SPLITS))}): its text would be cut "
                              "into other pieces than the model's")
    spell = byte_spelling()
    alphabet = set(spell.values())
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(v.get("tokens") or [])}
    merges = [tuple(m.split(" ", 1)) for m in v.get("merges") or []]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, dropout=None, fuse_unk=False,
                                          continuing_subword_prefix="", end_of_word_suffix=""))
    split = SPLITS[pre]
    tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                         pre_tokenizers.Sequence([
                             pre_tokenizers.Split(Regex(split), behavior="isolated"),
                             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]))
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece(v):
    """SentencePiece's BPE: "▁" for a space and one before the text, merges from the scores (or
    the file's own), unknown characters as their bytes."""
    tokens = v.get("tokens") or []
    merges = ([tuple(m.split(" ", 1)) for m in v["merges"]] if v.get("merges")
              else sentencepiece_merges(tokens, v.get("scores") or [0.0] * len(tokens)))
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                          fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


def template(tokens, v, add_bos, add_eos):
    """What every text gets around it: the begin-of-sequence token before, the end-of-sequence
    after, where the file says so."""
    def named(key):
        i = v.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None
    bos, eos = named("bos_token_id"), named("eos_token_id")
    add_bos, add_eos = bool(add_bos and bos), bool(add_eos and eos)
    single = " ".join([*[f"{bos}:0"] * add_bos, "$A:0", *[f"{eos}:0"] * add_eos])
    pair = " ".join([single, *[f"{bos}:1"] * add_bos, "$B:1", *[f"{eos}:1"] * add_eos])
    ids = [(bos, v["bos_token_id"])] * add_bos + [(eos, v["eos_token_id"])] * add_eos
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def special_ids(tokenizer_json_text):
    """{special token text: id} of a tokenizer.json: what a chat template's markers encode to."""
    return {a["content"]: a["id"] for a in json.loads(tokenizer_json_text)["added_tokens"]
            if a["special"]}
