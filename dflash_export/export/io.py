"""The graphs' inputs and outputs: names in positional order, and the dummy inputs a target is traced with."""

from __future__ import annotations

import torch

from dflash_export.nn.gated_delta import MAX_ROWS
from dflash_export.nn.qwen3_5 import hybrid_io_names
from runtime.graphs.tree import tree_bias_of
from runtime.manifest import DRAFT_PROPOSAL_OUTPUTS, TREE_INPUTS, TREE_SHAPE_INPUTS


def target_io_names(num_layers: int, draft_proposes: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names of the target graph, in positional order (`draft_proposes`: the target
    takes the proposal ids, `nn.layers.TargetForExport`)."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    if draft_proposes:
        return (["input_ids", "proposal_ids", "temperature", "uniform", *TREE_SHAPE_INPUTS, *kv_in],
                ["next_ids", "next_embeddings", "logits", "taps", *kv_out])
    return (
        ["input_ids", "draft_hidden", "temperature", "uniform", *TREE_INPUTS, *kv_in],
        ["next_ids", "proposal_ids", "next_embeddings", "logits", "taps", *kv_out],
    )


def draft_io_names(num_layers: int, proposes: bool = False, selects: bool = False) -> tuple[list[str], list[str]]:
    """Input and output names of the draft graph, in positional order (`proposes`: it ends in the
    proposal head, `nn.draft.ProposingDraft`; `selects`: a DFlash 2 selector, which also takes the
    block's anchor id, `nn.dflash2.DFlash2Draft`)."""
    kv_in = [f"past_{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    kv_out = [f"{kind}_{i}" for i in range(num_layers) for kind in ("key", "value")]
    heads = list(DRAFT_PROPOSAL_OUTPUTS) if proposes or selects else ["draft_hidden"]
    anchor = ["anchor_ids"] if selects else []
    return ["context_hidden", "block_embeddings", "proposal_rows", *anchor, *kv_in], [*heads, *kv_out]


def lazy_weight(read, dtype, shape, name: str):
    """An onnx_ir tensor of `dtype` and `shape` whose values `read()` (a torch tensor) gives when it is
    written, and not before."""
    import onnx_ir as ir

    return ir.LazyTensor(lambda: ir.tensor(read().numpy()), dtype=dtype, shape=shape, name=name)


def target_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a TargetForExport with.

    The dummy sizes (T=3, N=4, P=6, U=5) are distinct and >= 2 so the exporter does not specialise
    any dimension to 0, 1 or to another dimension.
    """
    spec = module.spec
    a = spec.arch
    dt = module.compute_dtype
    t, n, p = 3, 4, 6  # uniform gets n + 1 = 5 rows: still distinct from every other size
    proposes = module.draft_proposes
    proposals = (torch.randint(0, spec.vocab_size, (n,), dtype=torch.int64) if proposes
                 else torch.randn(n, a.hidden_size, dtype=dt))
    ranks = () if proposes else (torch.tensor([0, 0, 1, 2], dtype=torch.int64),)
    args = (
        torch.randint(0, spec.vocab_size, (t,), dtype=torch.int64),
        proposals,
        torch.zeros(1, dtype=torch.float32),
        torch.rand(n + 1, dtype=torch.float32),
        torch.tensor([0, 1, 0, 0], dtype=torch.int64),  # a tree: a chain of 2 and two alternatives
        *ranks,
        torch.tensor(tree_bias_of([-1, 0, -1, -1])),
        *[torch.randn(p, a.num_kv_heads, a.head_dim, dtype=dt) for _ in range(2 * a.num_layers)],
    )
    T = torch.export.Dim("new_tokens", min=1, max=1 << 20)
    N = torch.export.Dim("proposals", min=0, max=1 << 10)
    P = torch.export.Dim("past_len", min=0, max=1 << 20)
    U = torch.export.Dim("sampled_rows", min=0, max=1 << 10)  # 1 + N when sampling, 0 when greedy
    # forward(input_ids, proposals, temperature, uniform, *rest): the tree inputs and caches are `rest`
    rest = ({0: N}, *([{0: N}] * len(ranks)), {0: N, 1: N}, *({0: P} for _ in range(2 * a.num_layers)))
    dyn = ({0: T}, {0: N}, None, {0: U}, rest)
    return args, target_io_names(a.num_layers, proposes), dyn


def hybrid_target_inputs(module) -> tuple:
    """(dummy args, io names, dynamic shapes) to trace a `nn.qwen3_5.Qwen35TargetForExport` with. The dummy sizes
    (T=6, R=2, P=9, Pp=4) are distinct and >= 2 so the exporter specialises no dimension."""
    s = module.spec
    t, p, pp = 6, 9, 4
    caches = []
    for kind in s.layer_types:
        if kind == "full_attention":
            caches += [torch.randn(p, s.num_kv_heads, s.head_dim) for _ in range(2)]
        else:
            caches += [torch.randn(s.conv_kernel - 1, s.conv_dim), torch.randn(s.num_v_heads, s.key_head_dim,
                       s.value_head_dim) * 0.1, torch.randn(pp, s.conv_dim), torch.randn(pp, s.num_v_heads),
                       torch.randn(pp, s.num_v_heads)]
    args = (torch.randint(0, s.vocab_size, (t,)), torch.tensor([t - 1, 0], dtype=torch.int64), *caches)
    T = torch.export.Dim("new_tokens", min=1, max=MAX_ROWS)
    R = torch.export.Dim("logit_rows", min=1, max=MAX_ROWS)
    P = torch.export.Dim("past_len", min=0, max=1 << 20)
    Pp = torch.export.Dim("pending_rows", min=0, max=MAX_ROWS)
    dyn = []
    for kind in s.layer_types:
        dyn += [{0: P}, {0: P}] if kind == "full_attention" else [None, None, {0: Pp}, {0: Pp}, {0: Pp}]
    return args, hybrid_io_names(s), ({0: T}, {0: R}, tuple(dyn))
