"""The memory bound of `build` and `check` (issue 11), on a ~200M-parameter random checkpoint.

`dflash_export.eval.scale.export_memory` measures each command as a child process (the kernel's peak RSS of that
child) against 1.25 x its fp16 weight bytes + 1 GiB. At this size the fixed cost of torch and tracing fills
most of the 1 GiB, so one extra copy of the weights anywhere in a command fails the test;
scripts/export_memory.py prints the figures for real shapes.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.slow
def test_build_and_check_stay_within_the_memory_bound(tmp_path):
    from dflash_export.eval.scale import export_memory

    rows = export_memory.measure_shape(tmp_path, "ci", "fp16", check=True, max_seq_len=256)
    table = export_memory.format_rows(rows)
    assert [r["step"] for r in rows] == ["build", "check"], table
    for r in rows:
        assert r["status"] == 0, f"{r['step']} failed:\n{Path(r['log']).read_text()[-3000:]}"
        assert r["weight_bytes"] > 350 * 10**6, table  # the shape must stay big enough to catch a copy
        assert r["within_bound"], f"{r['step']} exceeded 1.25 x fp16 bytes + 1 GiB:\n{table}"
    data = tmp_path / "ci-fp16-artifact" / "target.onnx.data"
    assert data.stat().st_size >= 0.99 * rows[0]["weight_bytes"], table  # every matrix streamed to external data


def test_a_child_is_measured_alone_whatever_its_parent_holds(tmp_path):
    """The kernel's ru_maxrss of a child keeps the size it was forked with (a test worker holding models
    made `build` read as 1.47 GiB in CI): `run_measured` reads the child's own high-water mark."""
    import sys

    import numpy as np

    from dflash_export.eval.scale import export_memory

    ballast = np.ones(800_000_000 // 8)  # 0.8 GB resident in this process
    status, _, peak = export_memory.run_measured([sys.executable, "-m", "json.tool", "--help"], tmp_path / "step.log")
    assert ballast[-1] == 1.0
    assert status == 0 and peak < 300 * 2**20, peak


def test_a_hybrid_checkpoint_with_mtp_carries_the_head_that_build_reads():
    """`--mtp`: the `mtp.*` tensors, named after transformers' full-attention layer, are exactly
    `nn.mtp.MTPHead`'s own weights (~0.42 B parameters at the 27B shape, in the bound's weight bytes)."""
    import torch

    from dflash_export.checkpoint.hybrid import HybridSpec
    from dflash_export.eval.scale import export_memory
    from dflash_export.nn.mtp import MTPHead

    plain, _ = export_memory.checkpoint_spec("qwen3.8-27b", layers=4)
    shapes, config = export_memory.checkpoint_spec("qwen3.8-27b", layers=4, mtp=True)
    head = {k: v for k, v in shapes.items() if k.startswith("mtp.")}
    with torch.device("meta"):
        module = MTPHead(HybridSpec.from_config(config))
    assert head == {f"mtp.{k}": tuple(p.shape) for k, p in module.named_parameters()
                    if not k.startswith(("model.", "lm_head."))}
    assert config["mtp_num_hidden_layers"] == 1 and shapes == {**plain, **head}
    assert 0.42e9 < export_memory.weight_count(head) < 0.43e9
    with pytest.raises(ValueError, match="hybrid"):
        export_memory.checkpoint_spec("ci", mtp=True)
