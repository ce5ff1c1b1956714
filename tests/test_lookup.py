"""Prompt lookup's own promises (the loop's shared ones -- exactness in every mode -- are in
test_speculative.py, which runs over every drafter, this one included): it copies what
followed the longest, most recent matching n-gram, keeps copying a repeat whose period is
shorter than k, drafts nothing when nothing matches, and its index, kept up to date one
commit at a time, is the one a fresh scan of the text would build."""

import random

import pytest

import torch

from conftest import tiny_gpt
from draft_lookup import LookupDrafter
from sampler import Sampler
from speculative import generate_plain, generate_speculative


def drafter_for(target):
    """The shared tests' prompt lookup: the tiny target's peaked distributions make it repeat
    itself, so some rounds find an n-gram to copy and others draft nothing at all."""
    return LookupDrafter(target.config.vocab_size)


def drafter_on(seq, **kw):
    d = LookupDrafter(vocab_size=16, **kw)
    d.begin(torch.tensor([seq]), {})
    return d


def proposal(seq, k, **kw):
    return drafter_on(seq, **kw).propose(k, Sampler("greedy"))[0].tolist()


def test_copies_what_followed_the_longest_most_recent_match():
    # "3 4" is followed by 5 early on and by 9 later: the most recent wins
    assert proposal([3, 4, 5, 0, 3, 4, 9, 1, 2, 3, 4], 2) == [9, 1]
    # the 2-gram "0 4" matches where the 1-gram "4" alone would pick the later "4 9"
    assert proposal([0, 4, 7, 7, 4, 9, 0, 4], 2) == [7, 7]
    assert proposal([0, 4, 7, 7, 4, 9, 0, 4], 2, max_ngram=1) == [9, 0]


def test_a_short_repeat_is_continued_past_the_present():
    assert proposal([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # period 2, k 5
    assert proposal([8, 7, 7, 7], 3) == [7, 7, 7]


def test_no_match_drafts_nothing():
    assert proposal([1, 2, 3, 4, 5], 4) == []
    assert proposal([1, 2, 3, 1, 2], 4, min_ngram=3) == []


def test_rejection_q_is_one_hot_on_each_draft():
    d = drafter_on([1, 2, 1, 2])
    tokens, q = d.propose(3, Sampler("rejection", 1.0))
    assert q.shape == (3, 16) and torch.equal(q.argmax(-1), tokens) and torch.all(q.sum(-1) == 1)


def test_index_kept_up_to_date_equals_a_fresh_scan():
    rng = random.Random(0)
    for _ in range(20):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        d = drafter_on(seq)
        for _ in range(10):
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
            d.commit(len(new) - 1, torch.tensor(new), {})
            seq += new
            assert d.follower == drafter_on(seq).follower
            proposed = d.propose(4, Sampler("greedy"))[0].tolist()
            assert proposed == drafter_on(seq).propose(4, Sampler("greedy"))[0].tolist()


def test_rounds_with_and_without_drafts_stay_exact():
    """On the tiny target some rounds copy an n-gram and some draft nothing; greedy output is
    still plain decoding's, and the empty rounds cost one target forward each, like a plain step."""
    target = tiny_gpt(0)
    empty = full = 0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        p = torch.randint(0, target.config.vocab_size, (8,), generator=g).tolist()
        drafter = LookupDrafter(target.config.vocab_size)
        out, stats = generate_speculative(target, drafter, p, 40, 4, Sampler("greedy"))
        assert out == generate_plain(target, p, 40, Sampler("greedy"))
        empty += stats.rounds - stats.drafted_at[0]
        full += stats.drafted_at[0]
        # the prefill, then one forward a round, drafts or not
        assert stats.target_forwards == stats.rounds + 1
    assert empty > 0 and full > 0


# -----------------------------------------------------------------------------
# the peer table: the same weights in transformers (runs only where transformers is)


def test_transformers_gpt2_holds_the_same_model():
    """benchmark/peers.py compares decoding speed on 'the same weights': its GPT2LMHeadModel must
    compute the target's logits, or the comparison is between two different models."""
    pytest.importorskip("transformers")
    from benchmark.peers import hf_generate, to_transformers
    target = tiny_gpt(0, scale=1.0)
    hf = to_transformers(target.float(), 0).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, target.config.vocab_size, (2, 40), generator=g)
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, target.double()(x)[0], atol=1e-10, rtol=0)
    p = x[0, :8].tolist()
    assert hf_generate(hf, p, 20, set()) == generate_plain(target, p, 20, Sampler("greedy"))
    assert hf_generate(hf, p, 20, set(), lookup=5) == generate_plain(target, p, 20,
                                                                     Sampler("greedy"))


# -----------------------------------------------------------------------------
# a drafter that is not a network fits as it is: a datastore saved and loaded, no nn.Module


class BigramStore:
    """A retrieval drafter's datastore (REST's idea, tiny): for each token, the token that most
    often followed it in the text it was built from. Plain tensors, no nn.Module, no parameters."""

    def __init__(self, config, target):
        self.next = torch.zeros(config["vocab"], dtype=torch.long)

    @classmethod
    def built_from(cls, ids, vocab):
        store = cls({"vocab": vocab}, None)
        counts = torch.zeros(vocab, vocab, dtype=torch.long)
        counts.index_put_((ids[:-1], ids[1:]), torch.ones(len(ids) - 1, dtype=torch.long),
                          accumulate=True)
        store.next = counts.argmax(1)
        return store

    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"].clone()


class BigramDrafter(LookupDrafter):
    """Chains the store from the last confirmed token: k tokens, each the likeliest successor."""
    name = "bigram"

    def __init__(self, store, target):
        super().__init__(target.config.vocab_size)
        self.store = store

    def propose(self, k, sampler):
        toks, t = [], self.seq[-1]
        for _ in range(k):
            t = int(self.store.next[t])
            toks.append(t)
        return self.as_draft(toks, sampler)


def test_a_datastore_drafter_saves_and_loads_without_being_a_network(target, tmp_path):
    from runtime.checkpoint import load_trained, save_checkpoint
    from runtime.declaration import Declaration
    V = target.config.vocab_size
    prompts = ([4, 5, 6], [7, 1, 7, 1])
    # built from the target's own text on these prompts (a datastore of what it says)
    text = [t for p in prompts for t in p + generate_plain(target, p, 30, Sampler("greedy"))]
    store = BigramStore.built_from(torch.tensor(text), V)
    ckpt = {"model_hash": "m", "tokenizer_hash": "t"}
    save_checkpoint({"kind": "bigram", "config": {"vocab": V}, "state_dict": store.state_dict(),
                     "target_hash": "m", "tokenizer_hash": "t"}, tmp_path / "bigram.pt")
    declared = Declaration(name="bigram", network=BigramStore, drafter=BigramDrafter)
    drafter = load_trained(declared, tmp_path / "bigram.pt", target, ckpt)
    assert not isinstance(drafter.store, torch.nn.Module)
    assert torch.equal(drafter.store.next, store.next)
    for prompt in prompts:
        out, stats = generate_speculative(target, drafter, prompt, 30, 4, Sampler("greedy"))
        assert out == generate_plain(target, prompt, 30, Sampler("greedy"))
        assert sum(stats.accepted_at) > 0  # the store drafts what the target says
