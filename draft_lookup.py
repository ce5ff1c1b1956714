"""
draft_lookup.py -- prompt lookup: a drafter with no network, no training and no checkpoint.

draft_small.py drafted with a small GPT of its own; draft_mtp.py, draft_dflash.py and
draft_dspark.py with networks trained on the target's hidden states. This file drops the network
altogether and adds the drafter a practitioner tries first (Saxena 2023, "prompt lookup
decoding"; transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`, llama.cpp's lookup
decoding): if the last n tokens of the text occurred earlier in it, guess that what followed
them then follows them again. Text repeats itself -- code above all: names, calls, whole
lines -- so this guess is often right, and it costs a dictionary lookup, not a forward pass.

Two things it shows that the learned drafters cannot:
  - a drafter's cost matters as much as its acceptance: this one accepts less per round than a
    trained drafter, but its drafts are free;
  - a drafter may have nothing to say. When no n-gram matches, it offers zero tokens and the
    loop takes a plain one-token step (a verify of [last] alone). The loop never asks why.

Exact in all three modes like every drafter: greedy and coupled compare tokens only; rejection
sampling gets the drafter's honest q, a one-hot on each drafted token (it is deterministic), so
a draft d survives with probability p(d) and a rejection resamples from p with d removed.

The index: for every n in [min_ngram, max_ngram] a dict from an n-gram to the position of the
token that followed its most recent occurrence. Each commit adds only the n-grams that just got
a follower, so a lookup and an update cost microseconds whatever the length of the text.
"""

import torch
import torch.nn.functional as F

from speculative import Drafter

# -----------------------------------------------------------------------------


class LookupDrafter(Drafter):
    """Drafts by copying what followed the text's last n-gram where it occurred before.

    A round on its own, run as written (tests/test_layout.py runs every example of the lesson),
    beside a tiny random target in float64, on a prompt that repeats itself:

        >>> from gpt import GPT, GPTConfig
        >>> from sampler import Sampler
        >>> from speculative import generate_plain, generate_speculative
        >>> _ = torch.manual_seed(0)
        >>> target = GPT(GPTConfig(sequence_len=64, vocab_size=97, n_layer=2, n_head=2,
        ...                        n_embd=32)).double().eval()
        >>> drafter = LookupDrafter(target.config.vocab_size)
        >>> prompt, greedy = [5, 6, 7, 5, 6, 7, 5, 6], Sampler("greedy")
        >>> out, stats = generate_speculative(target, drafter, prompt, 12, 4, greedy)
        >>> out == generate_plain(target, prompt, 12, greedy), stats.rounds > 0
        (True, True)
    """
    name = "lookup"
    # its drafts cost nothing to make, so a long one pays whenever the text repeats; 10 is among
    # the best of a greedy sweep, and transformers' documented example (docs/experiments.md:
    # Lookup: k)
    default_k = 10

    def __init__(self, vocab_size, max_ngram=3, min_ngram=1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) "
                             f"<= max ({max_ngram})")
        self.vocab_size = vocab_size
        # longest first: the most specific match wins
        self.ngram_sizes = range(max_ngram, min_ngram - 1, -1)

    def begin(self, tokens, hidden):
        self.device = tokens.device
        # the confirmed sequence, on the host: it is only ever indexed
        self.seq = tokens.view(-1).tolist()
        self.follower = {n: {} for n in self.ngram_sizes}  # n -> {n-gram: where its next token is}
        self._index(0)

    def _index(self, start):
        """Record the n-grams whose following token sits at positions start .. len(seq) - 1."""
        seq = self.seq
        for j in range(max(start, 1), len(seq)):
            for n in self.ngram_sizes:
                if j >= n:
                    # later occurrences overwrite: the most recent wins
                    self.follower[n][tuple(seq[j - n:j])] = j

    def match(self):
        """Where the text continued after the longest n-gram that ends the sequence (None: no
        match). The sequence's own last n-gram is never in the index: its next token is not
        known yet."""
        for n in self.ngram_sizes:
            if len(self.seq) >= n:
                j = self.follower[n].get(tuple(self.seq[-n:]))
                if j is not None:
                    return j
        return None

    def match_length(self, j, cap=16):
        """How many tokens before position j equal the sequence's last ones, up to `cap`: at least
        the matched n-gram, often far more. A long match is a repeat in progress, which is what
        draft_hybrid.py reads to choose between copying and drafting."""
        seq, S, m = self.seq, len(self.seq), 0
        while m < cap and m < j and seq[j - 1 - m] == seq[S - 1 - m]:
            m += 1
        return m

    def copy(self, j, k):
        """The k tokens after position j, as host ints. If they run into the present (a repeat with
        period < k), keep copying from the copy: the text is predicted to go on repeating."""
        ext = self.seq[j:j + k]
        while len(ext) < k:
            ext = ext + ext[:k - len(ext)]
        return ext[:k]

    def as_draft(self, draft, sampler):
        """Host ints -> (tokens, q) as propose returns them: q a one-hot on each drafted token in
        rejection mode (the drafts are deterministic), else None."""
        tokens = torch.tensor(draft, dtype=torch.long, device=self.device)
        q = None
        if sampler.mode == "rejection":
            q = F.one_hot(tokens, self.vocab_size).to(torch.float32)
        return tokens, q

    def propose(self, k, sampler):
        j = self.match()
        return self.as_draft(self.copy(j, k) if j is not None else [], sampler)

    def commit(self, n, new, hidden):
        self.extend(new.tolist())

    def extend(self, ids):
        """The sequence grew by `ids` (host ints): index the n-grams that just got a follower."""
        start = len(self.seq)
        self.seq.extend(ids)
        self._index(start)


# -----------------------------------------------------------------------------
# declared once: what the house reads of this file (registry/drafters.py lists it). No network,
# so no checkpoint and no stage: it is built for the target's vocabulary.

DRAFTER = dict(
    name="lookup",
    drafter=lambda network, target: LookupDrafter(target.config.vocab_size),
    # the text lives on the host: the prompt read at begin, the new tokens at commit, the draft
    # uploaded
    syncs={"begin": (1, 0), "propose": (0, 1), "commit": (1, 0)},
)
