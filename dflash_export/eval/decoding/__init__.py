"""Decoding measurements: the `bench` command, its report and modes (A/B, replay, draft ranks, verify costs),
the PyTorch reference loop, the DFlash 2 selector walk and the drafter fixtures."""
