"""Evaluation: `bench`, policy replay on recorded traces and the plain PyTorch DFlash loop."""
