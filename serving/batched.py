"""
serving/batched.py -- what serving adds to the loop: a serving rule's say over each batch.

speculative.generate_batch decodes B prompts of different lengths together, every target
forward shared by all of them (ragged.py), and generate_plain_batch is the baseline at batch B. What changes with load: at batch 1 a 16-token verify
costs little more than a 1-token step, so drafting long always pays. At batch 32 the same verify
is a 512-token forward and costs several times a plain batched step: a fixed draft length turns
into a slowdown. DSpark's scheduler (draft_dspark.py) spends one verify over the whole batch
instead; its measured rule (serving/rules.py) sets each round's width by what the rounds
measured, and may decode a batch plainly where no draft pays (serve()).

Rows are exact one by one: greedy and coupled sampling give each row the tokens its own batch-1
decoding gives (the coupled noise is keyed on the row's own seed and absolute positions);
rejection sampling gives each row the target's distribution, from the row's own generator.

    python bench.py --batch-size 1,4,16,32     # the serving sweep: every method, batched
"""

from speculative import Stats, generate_batch, generate_plain_batch

# -----------------------------------------------------------------------------
# the batched drafter interface


class BatchDrafter:
    """A serving rule around a lesson drafter (serving/rules.Measured): the drafter's batch calls
    (speculative.Drafter's begin_batch, propose_batch, commit_batch), with what the rule adds:

    plain_batch(B)             asked before each batch of B rows: True decodes it on plain
                               decoding's own path, start to end (where no draft pays); the
                               drafter then sees nothing of it but timed_plain(B, steps,
                               seconds), the plain steps' time.
    one_request()              the drafter that decodes a batch of one: the lesson's own.
    """
    name = "drafter"
    hidden_layers = ()
    max_k = None
    default_k = 4
    sampled_k = None
    budget = []

    def __init__(self, drafter):
        """The rule around `drafter`: it drafts what that one would, so it takes its name, the
        target layers it reads, its k and its training record."""
        for name in ("name", "hidden_layers", "max_k", "default_k", "sampled_k"):
            setattr(self, name, getattr(drafter, name))
        self.budget = getattr(drafter, "budget", [])
        self.single = drafter

    def one_request(self):
        return self.single

    def plain_batch(self, B):
        return False  # a drafter without a rule of its own drafts every batch

    def timed_plain(self, B, steps, seconds):
        pass


# -----------------------------------------------------------------------------
# a batch as a server decodes it


def serve(target, drafter, prompts, max_new_tokens, k, sampler, cache=None, stop=()):
    """speculative.generate_batch, with what a serving rule decides (BatchDrafter): a batch of
    one runs the lesson's own drafter (its own scheduler), and a batch where no draft pays is
    decoded plainly, start to end, the drafter told the plain steps' time. -> (token lists,
    Stats)."""
    if isinstance(drafter, BatchDrafter):
        if len(prompts) == 1:
            drafter = drafter.one_request()
        elif drafter.plain_batch(len(prompts)):
            stats = Stats.of(k, len(prompts))
            out = generate_plain_batch(target, prompts, max_new_tokens, sampler, cache, stats,
                                       stop)
            drafter.timed_plain(len(out), max(len(o) for o in out) - 1, stats.verify_time)
            return out, stats
    return generate_batch(target, drafter, prompts, max_new_tokens, k, sampler, cache, stop=stop)
