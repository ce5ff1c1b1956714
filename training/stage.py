"""
training/stage.py -- what a stage of train.py is: the training-side twin of speculative.Drafter.

A drafter with a checkpoint has a stage, declared once at the end of its stage file
(training/stages_<name>.py) as STAGE = Stage(...): its settings, what it trains in which phases,
how it trains, and what a step costs. registry/drafters.py pairs it with the drafter's lesson file;
train.py runs the target's stage (training/stages_target.py), then every drafter's in the registry's
order, each skipped while its checkpoint out/<name>.pt is current.

A stage's train(trainer, cfg) is a plain function: it builds what it trains, hands each phase to
the trainer's loop (tr.fit: the learning-rate schedule, forward to the loss, loss.backward(), the
clip, optimizer.step()), which gives back the phase's validation loss; then it writes its
checkpoint and returns that loss:

    def train(tr, cfg):                      # cfg: this stage's settings, typed
        net = MyNet(...).to(tr.device)
        batches = tr.distill.batches("gen")   # the target's own text, and its features on it
        val = tr.fit("mine", net, lambda step: my_loss(net, *batches(step)),
                     evaluate=lambda: tr.val_loss(...), steps=cfg.iters, lr=cfg.lr,
                     fingerprint={...}, tokens_per_step=...).val_loss
        tr.save(net.config.to_dict(), net, {"val_loss": val})   # out/mine.pt
        return val

A drafter that builds what it drafts from without learning it (a datastore of the corpus's
n-grams, say) calls no tr.fit: it builds from tr.corpus() and saves, and nothing of it is wrapped
for training.

What a stage reads is its own settings (cfg), the run's (tr.run: the corpus, the target's shape,
the batch, the seed) and the Trainer's services (training/trainer.py); a stage whose network is
built from another stage's settings (DSpark's backbone: DFlash's) declares it (builds_on) and
reads them as tr.run.settings[name].
"""

from dataclasses import dataclass
from typing import Callable

from runtime.settings import number, setting, settings_of, values_of
from training.distill import DistillSettings


@dataclass
class SharedSettings:
    """What every stage shares: train.py's flags --block-size, --batch-size, --warmup."""
    block_size: int = setting(256, "context window (target and drafters; with --init-from at most "
                              "the model's, whose first positions are kept)", cuda=512, tiny=64,
                              **{"real-cpu": 1024})
    batch_size: int = setting(8, "sequences per optimizer step (every stage; under torchrun the "
                              "global batch, split over the processes)", cuda=32, gpt2=16, tiny=4,
                              **{"real-gpu": 32})
    warmup: int = setting(60, "linear warmup steps before the cosine decay (every stage)",
                          type=number(int, 0), cuda=200, quick=20, tiny=5, **{"real-gpu": 200})


@dataclass(frozen=True)
class Stage:
    """How a drafter learns, declared once in its stage file.

    settings    its settings: a dataclass whose fields (runtime.settings.setting) hold each
                default, its help and what each preset changes; train.py's flags --<name>-<field>
                set them, and the stage gets them as one typed object (cfg)
    phases      phases(cfg, run) -> [(phase, steps)], what it trains in order (for the time
                estimate and the resume files), refusing settings that cannot work: train.py asks
                every stage before any trains
    train       train(trainer, cfg): a plain function (above) that writes out/<name>.pt and
                returns its validation loss
    step_cost   {phase: seconds of one of its steps / seconds of one target step} on the reference
                CPU with the cpu preset (docs/results.md: Training): the run's time estimate
                until the run has measured its own
    builds_on   the stage whose settings also build this one's network (DSpark: DFlash's): they
                go in its checkpoint's record of its settings too
    reads       the other stages whose settings it reads (run.settings[name]) besides the one it
                builds on: DFlash reads DSpark's iters, to keep the state DSpark branches off
    files       the other files it writes in out/ (DFlash: the state DSpark branches off)
    records     records(run) -> the settings its checkpoint records, where they are not the usual
                ones (usual_record, below: the target's stage says its own)
    format      the layout of what its train saves: raise it when that changes, and a checkpoint
                written in another is not current (it is retrained, as one of other settings)

    Its phases are named after it (`dflash`, `dflash-narrow`): they name its resume files and
    their step costs, and a phase's learning rate is the setting `lr` (or `<phase>_lr`), the flag
    named when it diverges.
    """
    settings: type
    phases: Callable
    train: Callable
    step_cost: dict
    builds_on: str = None
    reads: tuple = ()
    files: tuple = ()
    records: Callable = None
    format: int = 1


def usual_record(run, name, stage):
    """What a drafter's checkpoint records of the settings (one trained with other values is not
    current): the seed, the shared settings, its own (and those of the stage it builds on, under
    their flags' names: dflash_block), and the distillation set's."""
    values = {n: getattr(run, n) for n, _ in settings_of(SharedSettings)}
    for own in (name, stage.builds_on):
        if own is not None:
            values.update(values_of(run.settings[own], own))
    values.update({n: getattr(run, n) for n, _ in settings_of(DistillSettings)})
    return {"seed": run.seed, **values}


def dropped(run, name):
    """Does --drafters leave this stage out?"""
    drafters = getattr(run, "drafters", "all")
    return drafters != "all" and name != "target" and name not in drafters.split(",")


def left_out(run, name):
    """Does this run leave the stage out: --only names another, or --drafters does not name it?"""
    if getattr(run, "only", None):
        return name != run.only
    return dropped(run, name)
