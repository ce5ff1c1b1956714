"""How train.py trains: the one training loop and its plumbing (trainer.py), what a stage is, the
target's stage and each drafter's (each with its settings), the corpus and its tokenizer, the
distillation set, resume and fingerprints, the flags, the split over processes (torchrun), and
what a forward costs here."""
