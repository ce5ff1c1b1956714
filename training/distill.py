"""
training/distill.py -- the text every drafter learns from, written by the target itself.

The papers regenerate their drafters' training text with the target, so that a drafter learns what
the target will say, not what the corpus said. train.py trains the target on the corpus
(training/data.py); this file then has it continue corpus prompts once, a quarter of them sampled
and the rest greedy, and keeps the result in out/distill.pt for every drafter stage and every later
run. On that text it also computes, once, the target's logits (the soft labels) and hidden states
(the drafters' inputs), and serves both as training batches.

A drafter's training reaches it as `trainer.distill` (train.py builds it): batches(text),
features(x), write(n, n_sampled, split) and key(text), what a resume fingerprint records.
"""

import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training import ddp
from runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from runtime.settings import number, setting


CACHE_LIMIT = 8 * 2**30  # bytes of host memory the feature cache may take (per process)


@dataclass
class DistillSettings:
    """The distillation set's settings: train.py's flags --gen-seqs, ..., --feature-cache."""
    gen_seqs: int = setting(1024, "sequences the target writes once (out/distill.pt) for every "
                            "drafter stage with text 'gen'", cuda=2048, gpt2=4096, quick=128,
                            tiny=8)
    gen_sampled: float = setting(0.25, "share of them sampled at --gen-temperature instead of "
                                 "greedy (so drafters see sampled text too)",
                                 type=number(float, 0, 1))
    gen_temperature: float = setting(0.8, "temperature of the sampled share (the papers "
                                     "regenerate at about 0.7)")
    feature_cache: int = setting(1, "1: run the target over the distillation set once and keep its "
                                 "logits and states in host memory (bfloat16); 0: every step",
                                 type=number(int, 0, 1), cuda=0)


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
        self.tokens, self.cache, self.shared = None, None, 0.0
        self.rows = None  # a slice of each training batch (this process's shard, ddp.shard)
        self.said_too_big = False
        self.world = getattr(run, "world", None) or ddp.World()

    def settings(self):
        """Everything the set depends on: what out/distill.pt records, and what the resume
        fingerprint of every stage that learns from it records."""
        a = self.run
        return {"target": self.target()[1]["model_hash"], "seqs": a.gen_seqs,
                "sampled": round(a.gen_seqs * a.gen_sampled), "temperature": a.gen_temperature,
                "block_size": a.block_size, "seed": a.seed}

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
                tokens = self.write(self.run.gen_seqs, want["sampled"], "train").cpu()
                ck = {"kind": "distill", "settings": want, "state_dict": {}, "tokens": tokens}
                save_checkpoint(ck, path)
                self.shared += time.time() - t0
            self.tokens = ck["tokens"].to(self.device)
        return self.tokens

    def features(self, x):
        """The frozen target on windows x (B, T): its logits (B, T, V) and every layer's hidden
        states {layer: (B, T, d)}: the soft labels and the inputs of every drafter's loss."""
        target = self.target()[0]
        with torch.no_grad():
            logits, _, hid = target(x, hidden_layers=range(1, target.config.n_layer + 1))
        return logits, hid

    def cached(self):
        """features() of the whole set, computed once per run and kept in host memory in bfloat16
        (docs/experiments.md: Distillation set and feature cache): the drafter stages then never
        run the target while they train. Computed under the training autocast, so the numbers are
        the ones an on-the-fly forward would give."""
        if self.cache is None:
            pool, t0, chunks = self.text(), time.time(), []
            with torch.autocast(self.device.split(":")[0], torch.bfloat16,
                                enabled=self.run.use_bf16):
                for i in range(0, len(pool), 32):
                    logits, hid = self.features(pool[i:i + 32])
                    chunks.append((logits.to("cpu", torch.bfloat16),
                                   {l: h.to("cpu", torch.bfloat16) for l, h in hid.items()}))
            self.cache = (torch.cat([c[0] for c in chunks]),
                          {l: torch.cat([c[1][l] for c in chunks]) for l in chunks[0][1]})
            print("the target's logits and hidden states on the distillation set, once: "
                  f"{time.time() - t0:.0f}s")
            self.shared += time.time() - t0
        return self.cache

    def cache_fits(self, pool):
        """--feature-cache 1, and the cache would take at most CACHE_LIMIT of host memory (with
        GPT-2's 50,257-token vocabulary the logits alone outgrow a host's memory at the cpu preset's
        size: 1,024 x 256 positions x 50,257 in bfloat16);
        otherwise the features are computed every step, saying so once."""
        if not self.run.feature_cache:
            return False
        c = self.target()[0].config
        size = pool.numel() * (c.vocab_size + c.n_layer * c.n_embd) * 2  # bfloat16
        if size > CACHE_LIMIT and not self.said_too_big:
            self.said_too_big = True
            print(f"distill: the feature cache would take {size / 2**30:.0f} GiB of host memory; "
                  "computing the target's features every step instead (--feature-cache 0)")
        return size <= CACHE_LIMIT

    def batches(self, text, sampled_only=False):
        """step -> (x, logits, hidden): batch_size training windows with the target's features
        on them. 'gen': rows of the set (sampled_only: only its sampled share, the last rows),
        features from the cache (--feature-cache 1) or computed per step; 'data': corpus
        windows, features per step."""
        a = self.run
        pool = self.text() if text == "gen" else None
        cache = self.cached() if pool is not None and self.cache_fits(pool) else None
        first = len(pool) - self.settings()["sampled"] if sampled_only else 0

        def batch(step):
            if pool is None:
                x = self.corpus.get("train", step, self.device)[0]
                return (x, *self.features(x))
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + step + 7_777_777 * sampled_only)
            idx = first + torch.randint(len(pool) - first, (a.batch_size,), generator=g)
            if self.rows is not None:
                idx = idx[self.rows]
            x = pool[idx.to(self.device)]
            if cache is None:
                return (x, *self.features(x))
            logits = cache[0][idx].to(self.device)
            hid = {l: h[idx].to(self.device, torch.float32) for l, h in cache[1].items()}
            return x, logits, hid
        return batch
