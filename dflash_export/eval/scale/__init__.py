"""Measurements at real model shapes: random checkpoints of released shapes, export memory, memory tables."""
