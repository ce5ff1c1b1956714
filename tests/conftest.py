"""Shared fixtures: a tiny float64 target, and every registered drafter for it, so that each
equivalence test runs over all of them. The list is the registry's (registry/drafters.py); each
drafter's test file (tests/test_<name>.py) says how the shared tests build it for a target,
drafter_for(target) (fitted a few steps where it has weights, so that it agrees with the target
some of the time), and may add VARIANTS, {variant: factory}, run by the shared tests too as
"<name>-<variant>"."""

import importlib
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from runtime import cpu_speed  # noqa: E402
from training import data  # noqa: E402
import train  # noqa: E402
from registry import drafters as registry  # noqa: E402
from runtime.cpu_speed import speed_up  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

VOCAB = 64

# what train.py, bench.py and sample.py switch on at start: attention written out when training on
# a CPU (cpu_speed.cpu_sdpa). On from the start, so that the drafters fitted below come out the
# same whichever test (or the shared train.py run) comes first
cpu_speed.enable()


def peaked(model, scale):
    """Scale random weights up so distributions are peaked (near-uniform logits would make
    every drafter 'agree' under shared noise, and rejections rare)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def tiny_gpt(seed, n_layer=2, n_embd=32, n_head=2, vocab=VOCAB, sequence_len=96, scale=8.0):
    """With the CPU speed-ups the loaders give every model (cpu_speed.speed_up)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=vocab, n_layer=n_layer, n_head=n_head,
                    n_embd=n_embd)
    return speed_up(peaked(GPT(cfg), scale).double().eval())


@pytest.fixture(scope="session")
def target():
    return tiny_gpt(0)


# llama.py's family, as tiny targets: grouped K/V heads in both; Llama-3's rope scaling and
# attention biases in one, Qwen3's q/k norms, a head_dim apart from n_embd / n_head and a tied
# head in the other
LLAMAS = {
    "llama": dict(n_head=4, n_kv_head=2, head_dim=8, qkv_bias=True, proj_bias=True,
                  rope_theta=500000.0, rope_scaling={
                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3": dict(n_head=4, n_kv_head=2, head_dim=16, qk_norm=True, tie_embeddings=True,
                  rope_theta=1e6),
}


def tiny_llama(family, seed=0, vocab=VOCAB, sequence_len=96, scale=8.0):
    """A tiny llama.Llama of LLAMAS[family], peaked as tiny_gpt's, its norms and biases moved
    away from their init (so that a weight read into the wrong place shows)."""
    from llama import Llama, LlamaConfig
    torch.manual_seed(seed)
    model = Llama(LlamaConfig(sequence_len=sequence_len, vocab_size=vocab, n_layer=2, n_embd=32,
                              n_hidden=64, **LLAMAS[family]))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return speed_up(peaked(model, scale).double().eval())


def target_text(target, seed, length):
    """16 sequences the target writes itself (sampled from 4 random tokens): what a drafter
    should learn to predict."""
    g = torch.manual_seed(seed)
    with torch.no_grad():
        x = torch.randint(0, target.config.vocab_size, (16, 4), generator=g)
        while x.size(1) < length:
            probs = torch.softmax(target(x)[0][:, -1], -1)
            x = torch.cat([x, torch.multinomial(probs, 1, generator=g)], 1)
    return x


def adam_fit(net, loss_fn, steps, target):
    """A few Adam steps on loss_fn(); only `net` steps (the target's shared head gets gradients
    too)."""
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = loss_fn()
        opt.zero_grad()
        loss.backward()
        opt.step()
    target.zero_grad(set_to_none=True)
    return net.eval()


def fitted(cache, key, fit):
    """fit() once per key: a drafter's network fitted for one target, kept for every test (a test
    may call this inside inference_mode; fitting needs gradients)."""
    if key not in cache:
        with torch.inference_mode(False), torch.enable_grad():
            cache[key] = fit()
    return cache[key]


# -----------------------------------------------------------------------------
# every registered drafter, built for a target as its own test file says


def own_tests(name):
    """A registered drafter's own test file, tests/test_<name>.py (None: it has none yet)."""
    if not os.path.exists(os.path.join(os.path.dirname(__file__), f"test_{name}.py")):
        return None
    return importlib.import_module(f"test_{name}")


def drafter_names():
    """The drafters the shared tests run: every registered one, then its test file's VARIANTS."""
    names = registry.names()
    return names + [f"{n}-{v}" for n in names for v in getattr(own_tests(n), "VARIANTS", {})]


def make(name, target):
    """Drafter `name` (a registered drafter, or "<drafter>-<variant>") for this target, as its
    test file builds it."""
    drafter, _, variant = name.partition("-")
    tests = own_tests(drafter)
    if tests is None or not hasattr(tests, "drafter_for"):
        pytest.fail(f"{drafter} has no tests/test_{drafter}.py with drafter_for(target): the "
                    "shared tests build every registered drafter with it (README: Adding a "
                    "drafter of your own)", pytrace=False)
    return tests.VARIANTS[variant](target) if variant else tests.drafter_for(target)


def within(drafter, k):
    """k, or the most tokens this drafter drafts a round where that is fewer (a shared test asks
    every drafter for the same k)."""
    return min(k, drafter.max_k or k)


@pytest.fixture(autouse=True)
def registered(request):
    """A drafter's own test, tests/test_<name>.py beside a lesson file draft_<name>.py, fails
    while the drafter has no line in the registry (the shared tests would skip it unseen)."""
    name = request.module.__name__.removeprefix("test_")
    lesson = os.path.join(os.path.dirname(os.path.dirname(__file__)), f"draft_{name}.py")
    if os.path.exists(lesson) and name not in registry.names():
        pytest.fail(f"draft_{name}.py has no line in registry/drafters.py: add Entry(draft_{name}"
                    f", stages_{name}) (or Entry(draft_{name}) if it does not learn) with its "
                    "imports, so that the shared tests run it", pytrace=False)


def pytest_generate_tests(metafunc):
    """A test that takes `drafter_name` runs over every drafter (drafter_names)."""
    if "drafter_name" in metafunc.fixturenames:
        metafunc.parametrize("drafter_name", drafter_names())


# -----------------------------------------------------------------------------
# a real (tiny) train.py run, shared by the tests that only read its out/ folder


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small, fixed corpus: 40 stdlib files, so tokenizer + data take about a second."""
    d = tmp_path_factory.mktemp("corpus")
    for f in data.stdlib_files()[:40]:
        shutil.copy(f, d / f.name)
    return str(d)


def tiny_args(corpus, out, *extra):
    """train.py flags for a tiny run, on the CPU: the tests that use it prove CPU facts (same
    seed, bit-identical checkpoints). A later --device in `extra` wins (tests/test_device.py's
    device mode). bfloat16 autocast is set, not measured: measured on a busy machine, one run of
    a pair could train in float32 and the other in bfloat16, and their weights would differ."""
    vocab = [] if "--init-from" in extra else ["--vocab-size", "384"]  # a folder's own
    return ["--preset", "tiny", "--data", corpus, *vocab, "--out-dir", str(out),
            "--log-interval", "10", "--eval-interval", "1000", "--device", "cpu", "--bf16", "on",
            *extra]


@pytest.fixture(scope="session")
def trained(corpus, tmp_path_factory):
    """One full tiny pipeline (every stage), shared by the tests that only read it."""
    out = tmp_path_factory.mktemp("out")
    train.main(tiny_args(corpus, out))
    return out


@pytest.fixture
def out(trained, tmp_path):
    """A private copy of the tiny trained out/ folder, free to damage."""
    shutil.copytree(trained, tmp_path / "out")
    return tmp_path / "out"
