"""The plumbing around train.py's loop: the corpus and its tokenizer, the distillation set, the
stages (which network each trains, with which settings), resume and fingerprints, the split over
processes (torchrun), and a pretrained GPT-2 folder as the target."""
