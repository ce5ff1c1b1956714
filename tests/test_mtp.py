"""MTP: the module's inputs are aligned (position i sees h_i and t_{i+1}, predicts t_{i+2}),
training and drafting compute the same thing, the MTP caches after commits equal a
recomputation from scratch, and train.py's joint mode writes a head that belongs to its target.
The shared equivalence tests run the drafter drafter_for() builds (conftest.make)."""

import shutil

import pytest
import torch
import torch.nn.functional as F

import train
from registry import drafters as registry
from training import trainer
from registry.drafters import load_drafter
from runtime.checkpoint import CheckpointError
from conftest import adam_fit, fitted, target_text, tiny_args
from draft_mtp import MTP, MTPConfig, MTPDrafter, lm_logits, mtp_loss
from draft_small import total_variation
from runtime.cpu_speed import speed_up
from sampler import Sampler
from runtime.target import load_target

_FITTED = {}


def fit_mtp(target, n_modules=2, steps=30):
    """A random MTP head, then a few Adam steps distilling the target on its own samples: it
    now agrees with the target SOME of the time (a purely random head never does), so the
    shared tests walk through full acceptance, partial acceptance and rejection alike."""
    def fit():
        torch.manual_seed(2)
        mtp = MTP(MTPConfig.for_target(target.config, n_modules)).double()
        last = target.config.n_layer
        x = target_text(target, 2, 44)
        with torch.no_grad():
            logits, _, hid = target(x[:, :-1], hidden_layers=(last,))

        def loss_fn():
            return mtp_loss(mtp, target, hid[last], x[:, :-1], x[:, 1:], logits, distill=1.0)
        return adam_fit(mtp, loss_fn, steps, target)
    return fitted(_FITTED, (id(target), n_modules, steps), fit)


def drafter_for(target):
    """The shared tests' MTP: two chained modules, so that k >= 3 exercises the chain AND the
    recursive reuse of the last one."""
    return speed_up(MTPDrafter(fit_mtp(target), target))


def seq_of(target, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, target.config.vocab_size, (1, T), generator=g)


def hidden_of(target, x):
    with torch.no_grad():
        return target(x, hidden_layers=(target.config.n_layer,))[2][target.config.n_layer]


# -----------------------------------------------------------------------------
# alignment


@torch.no_grad()
def test_position_0_by_hand(target):
    """Index 0 attends only to itself, so the block is attention-free arithmetic: write it out."""
    mtp = fit_mtp(target, n_modules=1)
    x = seq_of(target, 12, 0)
    h = hidden_of(target, x)
    logits, targets = mtp(target, h, x[:, :-1], x[:, -1:])  # T = 11 inputs, t_11 is the last label
    m = mtp.mods[0]
    rms = lambda v, w: v / torch.sqrt((v * v).mean() + torch.finfo(v.dtype).eps) * w  # noqa: E731
    u = m.proj.weight @ torch.cat([rms(h[0, 0], m.norm_h.weight),
                                   rms(target.transformer.wte.weight[x[0, 1]], m.norm_e.weight)])
    b = m.layer
    q_k_v = b.attn.c_attn(b.ln_1(u))
    v = q_k_v[2 * u.numel():]  # softmax over one key is 1: the attention output is that key's value
    y = u + b.attn.c_proj(v)
    y = y + b.mlp(b.ln_2(y))
    want = target.lm_head(target.transformer.ln_f(y))
    assert torch.allclose(logits[0][0, 0], want, atol=1e-10, rtol=0)
    assert targets[0][0, 0].item() == x[0, 2].item()  # index 0 predicts t_2


@torch.no_grad()
def test_index_i_sees_t_i_plus_1_and_not_beyond(target):
    """Changing t_{i+1} moves index i; changing t_{i+2} (its label) or h_{i+1} does not."""
    mtp = fit_mtp(target, n_modules=1)
    x = seq_of(target, 20, 1)
    h = hidden_of(target, x)
    i = 7
    base = mtp(target, h[:, :-1], x[:, :-1], x[:, -1:])[0][0]
    for j, moves in ((i + 1, True), (i + 2, False)):
        x2 = x.clone()
        x2[0, j] = (x[0, j] + 1) % target.config.vocab_size
        # same h: only the token input changed
        out = mtp(target, h[:, :-1], x2[:, :-1], x2[:, -1:])[0][0]
        assert torch.allclose(out[0, :i], base[0, :i], atol=1e-12, rtol=0)  # the past never moves
        assert torch.allclose(out[0, i], base[0, i], atol=1e-12, rtol=0) != moves
    h2 = h.clone()
    h2[:, i + 1:] += 1.0
    out = mtp(target, h2[:, :-1], x[:, :-1], x[:, -1:])[0][0]
    assert torch.allclose(out[0, :i + 1], base[0, :i + 1], atol=1e-12, rtol=0)
    assert not torch.allclose(out[0, i + 1], base[0, i + 1])


@pytest.mark.parametrize("i", [0, 5, 17])
@torch.inference_mode()
def test_drafting_equals_training_forward(target, i):
    """A drafter on the prefix t_0..t_{i+1} proposes, for step 1, exactly the training forward's
    distribution at index i; step 2 (the chained second module) matches module 2 at index i once
    the training text continues with the token step 1 drafted."""
    mtp = fit_mtp(target, n_modules=2)
    x = seq_of(target, 24, 2)
    d = MTPDrafter(mtp, target)
    S = i + 2
    d.begin(x[:, :S], {target.config.n_layer: hidden_of(target, x[:, :S - 1])})
    draft, q = d.propose(2, Sampler("rejection", 1.0, None, 0))
    # the training text sees d_1 as t_{i+2}
    x2 = torch.cat([x[:, :S], draft.view(1, -1)[:, :1], x[:, S + 1:]], 1)
    logits, _ = mtp(target, hidden_of(target, x2[:, :-1]), x2[:, :-1], x2[:, -1:])
    assert torch.allclose(q[0], F.softmax(logits[0][0, i].double(), -1), atol=1e-10, rtol=0)
    assert torch.allclose(q[1], F.softmax(logits[1][0, i].double(), -1), atol=1e-10, rtol=0)


class Spy(Sampler):
    def __init__(self):
        super().__init__("greedy")
        self.positions = []

    def draft(self, logits, start, ks=None):
        first = start[0] if isinstance(start, list) else start  # a batch's (of one) row 0
        self.positions.append(list(range(first, first + logits.size(-2))))
        return super().draft(logits, start, ks)


@pytest.mark.parametrize("D", [1, 2])
@torch.inference_mode()
def test_drafts_are_keyed_on_their_absolute_positions(target, D):
    d = MTPDrafter(fit_mtp(target, n_modules=D), target)
    x = seq_of(target, 9, 3)
    d.begin(x, {target.config.n_layer: hidden_of(target, x[:, :-1])})
    spy = Spy()
    draft, _ = d.propose(4, spy)
    assert spy.positions == [[9], [10], [11], [12]] and draft.numel() == 4


# -----------------------------------------------------------------------------
# bookkeeping


@pytest.mark.parametrize("D", [1, 2])
@torch.inference_mode()
def test_cache_after_commits_equals_recomputing_from_scratch(target, D):
    """One request (a batch of one row). Drive propose/commit with made-up verdicts (full acceptance, partial, none, k=0) and the
    target's true hidden states. After each commit every module's cache holds exactly its exact
    entries (module j: indices < S_old - j) and they equal a fresh drafter's built in one go."""
    mtp = fit_mtp(target, n_modules=D)
    last = target.config.n_layer
    V = target.config.vocab_size
    d = MTPDrafter(mtp, target)
    seq = seq_of(target, 6, 4)[0]
    d.begin(seq.view(1, -1), {last: hidden_of(target, seq[:-1].view(1, -1))})
    # (k, n); k = 0: no propose
    plans = [(4, 4), (4, 0), (3, 2), (1, 1), (0, 0), (2, 0), (5, 5), (4, 1), (1, 0), (3, 3)]
    for rnd, (k, n) in enumerate(plans):
        S = seq.numel()
        draft = seq[:0]
        # the loop skips propose when it may not draft (the last token before max_new_tokens)
        if k > 0:
            draft, _ = d.propose(k, Sampler("greedy"))
            # module j ran up to index S-2; D recursed once per step past D
            for j, c in enumerate(d.caches, start=1):
                if j <= k:
                    assert c.lengths[0] == S - 1 + (k - D if j == D and k > D else 0), (rnd, j)
        new = torch.cat([draft[:n], torch.tensor([(rnd * 7) % V])])
        full = torch.cat([seq, new])
        hid = hidden_of(target, full[:-1].view(1, -1))
        d.commit(n, new, {last: hid[:, S - 1:S + n]})
        seq = full
        for j, c in enumerate(d.caches, start=1):
            if j <= k:
                assert c.lengths[0] == S - j, (rnd, j)  # every speculative entry is gone
        assert torch.allclose(d.H[0, 0, :seq.numel() - 1], hid[0], atol=1e-12, rtol=0)
        fresh = MTPDrafter(mtp, target)
        fresh.begin(seq.view(1, -1), {last: hid})
        fresh.propose(D, Sampler("greedy"))  # catches up every module in one chunk from index 0
        for c, f in zip(d.caches, fresh.caches):
            (n_ok,) = c.lengths
            assert torch.allclose(c.k[:, :, :, :n_ok], f.k[:, :, :, :n_ok], atol=1e-10, rtol=0)
            assert torch.allclose(c.v[:, :, :, :n_ok], f.v[:, :, :, :n_ok], atol=1e-10, rtol=0)


# -----------------------------------------------------------------------------
# training: the mtp loss is the mean of the modules' losses, and joint mode pairs head and target


@torch.no_grad()
def test_distill_mixes_ce_on_the_text_with_kl_and_tv_to_the_target(target):
    """The posthoc default (--mtp-distill 0.5): half CE on the text's token after next, half
    KL + TV to the target's own distribution of it (its logits one position on)."""
    mtp = fit_mtp(target, n_modules=1)
    x = seq_of(target, 16, 6)
    t_logits, _, hid = target(x[:, :-1], hidden_layers=(target.config.n_layer,))
    h = hid[target.config.n_layer]
    out = mtp.mods[0](h[:, :-1], target.transformer.wte(x[:, 1:-1]))
    logq = F.log_softmax(lm_logits(target, out), -1)[0]
    logp = F.log_softmax(t_logits[0, 1:], -1)
    ce = F.nll_loss(logq, x[0, 2:])
    kl_tv = ((logp.exp() * (logp - logq)).sum(-1) + total_variation(logq, logp.exp())).mean()
    for d in (0.0, 0.5, 1.0):
        loss = mtp_loss(mtp, target, h, x[:, :-1], x[:, 1:], t_logits, d)
        assert torch.allclose(loss, (1 - d) * ce + d * kl_tv, atol=1e-12, rtol=0), d


def test_loss_is_ce_on_the_token_after_next(target):
    mtp = fit_mtp(target, n_modules=1)
    x = seq_of(target, 16, 5)
    h = hidden_of(target, x[:, :-1])
    with torch.no_grad():
        loss = mtp_loss(mtp, target, h, x[:, :-1], x[:, 1:])
        logits = lm_logits(target, mtp.mods[0](h[:, :-1], target.transformer.wte(x[:, 1:-1])))
    want = F.cross_entropy(logits[0], x[0, 2:])
    assert torch.allclose(loss, want, atol=1e-12, rtol=0)


def test_joint_mode_writes_a_matching_head_and_posthoc_retrains_it(corpus, tmp_path):
    train.main(tiny_args(corpus, tmp_path, "--mtp-mode", "joint", "--only", "target"))
    target, target_ckpt = load_target(str(tmp_path / "target.pt"))
    joint = torch.load(tmp_path / "mtp.pt", weights_only=True)
    assert joint["mode"] == "joint" and joint["target_hash"] == target_ckpt["model_hash"]
    assert isinstance(load_drafter("mtp", str(tmp_path), target, target_ckpt), MTPDrafter)
    ctx = trainer.Trainer(train.resolve_args(tiny_args(corpus, tmp_path, "--mtp-mode", "joint")),
                          registry.stages())
    assert trainer.is_current(ctx, "mtp")  # so the mtp stage is skipped
    ctx = trainer.Trainer(train.resolve_args(tiny_args(corpus, tmp_path, "--mtp-mode",
                                                       "posthoc")), registry.stages())
    assert not trainer.is_current(ctx, "mtp")  # a posthoc run retrains the joint head
    train.main(tiny_args(corpus, tmp_path, "--mtp-mode", "posthoc", "--only", "mtp", "--force"))
    post = torch.load(tmp_path / "mtp.pt", weights_only=True)
    assert post["mode"] == "posthoc" and post["target_hash"] == target_ckpt["model_hash"]
    key = "mods.0.proj.weight"
    assert not torch.equal(post["state_dict"][key], joint["state_dict"][key])
    # a retrained target never pairs with the old head
    train.main(tiny_args(corpus, tmp_path, "--mtp-mode", "posthoc", "--only", "target", "--force",
                         "--seed", "7"))
    target2, target_ckpt2 = load_target(str(tmp_path / "target.pt"))
    with pytest.raises(CheckpointError, match="trained against target"):
        load_drafter("mtp", str(tmp_path), target2, target_ckpt2)


def test_config_roundtrip_and_size():
    cfg = MTPConfig(n_embd=32, n_head=2, n_modules=2, sequence_len=64)
    mtp = MTP(MTPConfig.from_dict(cfg.to_dict()))
    # M, two RMSNorms, one GPT-2 block with biases
    per = 2 * 32 * 32 + 2 * 32 + (12 * 32 * 32 + 13 * 32)
    assert sum(p.numel() for p in mtp.parameters()) == 2 * per


def test_checkpoints_written_with_the_old_names_are_one_line_naming_the_retrain(trained,
                                                                               tmp_path):
    """An earlier version named the context window `block_size` in every GPT and MTP config and
    an MTP module's transformer layer `block` (weights under mods.<i>.block.): such a checkpoint
    is refused in one line naming the command that trains it again."""
    out = shutil.copytree(trained, tmp_path / "out")
    for name in ("target", "small", "mtp", "eagle"):
        ck = torch.load(out / f"{name}.pt", weights_only=True)
        assert "sequence_len" in ck["config"]
        ck["config"] = {("block_size" if k == "sequence_len" else k): v
                        for k, v in ck["config"].items()}
        ck["state_dict"] = {k.replace(".layer.", ".block."): v for k, v in ck["state_dict"].items()}
        torch.save(ck, out / f"{name}.pt")
    with pytest.raises(CheckpointError, match="python train.py --only target --force"):
        load_target(str(out / "target.pt"))
    target, target_ckpt = load_target(str(trained / "target.pt"))
    for name in ("small", "mtp", "eagle"):
        with pytest.raises(CheckpointError, match=f"python train.py --only {name} --force"):
            load_drafter(name, str(out), target, target_ckpt)
