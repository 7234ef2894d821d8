"""`train-draft`: training a DFlash draft for a target that has none."""
