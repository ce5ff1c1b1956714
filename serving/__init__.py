"""Serving: many requests in one forward. The lesson decodes one request at a time; this package
runs the same drafters over a ragged batch (a KV cache with a length per row), with batched twins
of the drafters and the rules that decide how much of a batch to verify."""
