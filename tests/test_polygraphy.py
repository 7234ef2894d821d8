"""Parity driven through Polygraphy: the ONNX graphs (OnnxrtRunner) against the PyTorch export modules.

The PyTorch outputs enter Polygraphy as a second runner's `IterationResult`s in the same `RunResults`,
and `Comparator.compare_accuracy` checks every output with `SimpleCompareFunc` (`CompareFunc.simple`)
at an absolute tolerance from fp32 rounding (tests/tolerances.py; rtol 0, so only it can pass a value).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from runtime.graphs.tree import VerifyTree, chain_inputs, tree_inputs
from tolerances import fp32_bound

polygraphy = pytest.importorskip("polygraphy")
from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx  # noqa: E402
from polygraphy.comparator import Comparator, CompareFunc, IterationResult, RunResults  # noqa: E402

try:  # Polygraphy >= 0.53 deprecates CompareFunc.simple in favour of the class itself
    from polygraphy.comparator import SimpleCompareFunc as _Simple  # noqa: E402
except ImportError:  # pragma: no cover - older Polygraphy
    _Simple = CompareFunc.simple

from dflash_export.nn.draft import DraftWithRows  # noqa: E402
from dflash_export.export.io import draft_io_names, target_io_names  # noqa: E402

# ONNX and PyTorch differ by fp32 rounding (tests/tolerances.py): the target's longest reduction is its
# MLP's (2 x hidden 64) through 4 layers and the head; the draft's is fc's (3 taps x 64), then 2 layers
# and the norm. Each output's tolerance scales with its largest value in the PyTorch run.
TARGET_ROUNDING = dict(reduction=128, depth=5)
DRAFT_ROUNDING = dict(reduction=192, depth=4)

# Integer outputs (next_ids, proposal_ids) that are 0 in both runs give 0/0 in Polygraphy's relative error;
# the absolute error (0) decides, so the numpy warning is noise.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")


def _atol(torch_iters, rounding) -> dict:
    """Per output: twice one evaluation's fp32 rounding bound at that output's largest |value| (rtol 0)."""
    names = torch_iters[0].keys()
    return {n: 2 * fp32_bound(max(float(np.max(np.abs(it[n]), initial=0.0)) for it in torch_iters), **rounding)
            for n in names}


def _compare_func(atol: dict):
    return _Simple(atol=atol, rtol=0.0)


def _torch_results(module, feeds, in_names, out_names, runner_name="pytorch"):
    """Run `module` on each feed dict and wrap the outputs as Polygraphy iteration results."""
    results = []
    for feed in feeds:
        with torch.no_grad():
            outs = module(*[torch.from_numpy(np.ascontiguousarray(feed[n])) for n in in_names])
        results.append(
            IterationResult(
                outputs=OrderedDict((n, o.detach().numpy()) for n, o in zip(out_names, outs)),
                runner_name=runner_name,
            )
        )
    return results


def _compare(onnx_path, module, feeds, in_names, out_names, rounding):
    runner = OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]))
    results = Comparator.run([runner], data_loader=feeds)
    assert len(list(results.values())[0]) == len(feeds)
    torch_iters = _torch_results(module, feeds, in_names, out_names)
    results.append(("pytorch", torch_iters))
    atol = _atol(torch_iters, rounding)
    accuracy = Comparator.compare_accuracy(results, compare_func=_compare_func(atol))
    return results, torch_iters, accuracy, atol


def _target_feeds(t, module):
    """Prefill (with 2 proposals, so no output is empty), then a step on that past with 15 proposals."""
    a = t.spec.arch
    rng = np.random.default_rng(5)
    in_names, out_names = target_io_names(a.num_layers)
    head = module.head_weight().detach().numpy()

    def feed(ids, proposals, past, temperature=0.0, tree=None):
        f = OrderedDict(
            input_ids=np.asarray(ids, np.int64),
            draft_hidden=(6.0 * head[np.asarray(proposals)]).astype(np.float32),
            temperature=np.array([temperature], np.float32),
            uniform=rng.uniform(0.05, 0.95, len(proposals) + 1).astype(np.float32),
        )
        f.update(tree_inputs(tree) if tree is not None else chain_inputs(len(proposals)))
        f.update(zip(in_names[7:], past))
        return f

    empty = [np.zeros((0, a.num_kv_heads, a.head_dim), np.float32) for _ in range(2 * a.num_layers)]
    first = feed(rng.integers(0, t.spec.vocab_size, 7), rng.integers(0, t.spec.vocab_size, 2), empty)
    with torch.no_grad():
        outs = module(*[torch.from_numpy(v) for v in first.values()])
    past = [o.numpy() for o in outs[5:]]
    second = feed(rng.integers(0, t.spec.vocab_size, 1), rng.integers(0, t.spec.vocab_size, 15), past)
    # a verify tree (a chain of 2, 2 alternatives for its first position), sampled
    third = feed(rng.integers(0, t.spec.vocab_size, 3), rng.integers(0, t.spec.vocab_size, 4), past, 1.0, VerifyTree(2, 2))
    return [first, second, third], in_names, out_names


def test_polygraphy_target_onnx_vs_pytorch(tiny):
    t = tiny.target("qwen3_tied")
    feeds, in_names, out_names = _target_feeds(t, t.module)
    results, torch_iters, accuracy, atol = _compare(t.onnx_path, t.module, feeds, in_names, out_names, TARGET_ROUNDING)
    assert accuracy, f"Polygraphy: target ONNX and PyTorch outputs differ beyond fp32 rounding ({atol})"
    assert set(accuracy.output_names()) == set(out_names)
    # Every output was compared (nothing silently skipped), on every iteration.
    onnx_iters = results.lst[0][1]
    for it in onnx_iters:
        assert set(it.keys()) == set(out_names)
    assert len(onnx_iters) == len(torch_iters) == 3

    # The comparison has teeth: a perturbed reference fails it.
    bad = [IterationResult(outputs=OrderedDict(it.items()), runner_name="pytorch-perturbed") for it in torch_iters]
    bad[1]["taps"] = bad[1]["taps"] + 5 * atol["taps"]
    broken = RunResults()
    broken.append(results.lst[0])
    broken.append(("pytorch-perturbed", bad))
    assert not Comparator.compare_accuracy(broken, compare_func=_compare_func(atol))


def test_polygraphy_draft_onnx_vs_pytorch(tiny):
    dr = tiny.draft()
    a = dr.spec.arch
    in_names, out_names = draft_io_names(a.num_layers)
    rng = np.random.default_rng(9)
    k = len(dr.spec.target_layer_ids)

    def feed(c, b, rows, past):
        f = OrderedDict(
            context_hidden=rng.normal(0, 2, (c, k * a.hidden_size)).astype(np.float32),
            block_embeddings=rng.normal(0, 0.1, (b, a.hidden_size)).astype(np.float32),
            proposal_rows=np.arange(rows, dtype=np.int64),
        )
        f.update(zip(in_names[3:], past))
        return f

    module = DraftWithRows.view_of(dr.module)  # positional inputs in the graph's order
    empty = [np.zeros((0, a.num_kv_heads, a.head_dim), np.float32) for _ in range(2 * a.num_layers)]
    first = feed(6, 8, 7, empty)
    with torch.no_grad():
        outs = module(*[torch.from_numpy(v) for v in first.values()])
    past = [o.numpy() for o in outs[1:]]
    feeds = [first, feed(3, 8, 2, past), feed(1, 16, 15, past)]
    _, _, accuracy, atol = _compare(dr.onnx_path, module, feeds, in_names, out_names, DRAFT_ROUNDING)
    assert accuracy, f"Polygraphy: draft ONNX and PyTorch outputs differ beyond fp32 rounding ({atol})"
    assert set(accuracy.output_names()) == set(out_names)
