"""What bench.py measures and reports beyond the lesson: the prompt sets, the ablation rows, the
serving sweep, the papers' figures, the tables, the JSON and the plot."""
