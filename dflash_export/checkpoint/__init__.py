"""Reading and validating target and draft checkpoints, where they come from, and their weights."""
