"""Serving: many requests in one forward. The lesson's loop decodes a batch (one request: a batch
of one); this package adds a rule that decides, by what the rounds measure, how wide a batch
drafts and whether it drafts at all."""
