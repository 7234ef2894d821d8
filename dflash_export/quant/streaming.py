"""INT4 on the way out: each weight read from the checkpoint, quantized as its initializer is written
(the streamed export of a target or draft graph, `dflash_export.export.graphs`)."""

from __future__ import annotations

import torch

from dflash_export.checkpoint.weights import WeightSource
from dflash_export.quant.int4 import QuantConfig, proposal_head_block, rewrite_int4


def streaming_rewrite(treaders: dict, tsource: WeightSource, torch_dtype, qconfig, qnames: list[str], head_config):
    """The `rewrite(model, packed)` hook of `export.graphs._export`: each weight is read (stacked when packed),
    INT4-quantized when `qconfig` (and the proposal head rows with `head_config`) as its initializer
    is saved."""
    def rewrite(model, packed):
        read = read_packed(packed, treaders, tsource, torch_dtype)
        if qconfig is not None:
            rewrite_int4(model, graph_weight_names(qnames, packed, qconfig.lm_head and "draft_head" in treaders),
                         read, qconfig, torch_dtype)
        if head_config is not None and not (qconfig is not None and qconfig.lm_head):
            rewrite_int4(model, ["draft_head"], read, head_config, torch_dtype)
    return rewrite


def proposal_head_config(choice: str, has_rows: bool, qconfig, hidden: int):
    """The INT4 config of the proposal head rows, or None when they stay in the graph dtype (choice
    "full", no proposal vocabulary, or --quant-lm-head, which quantizes them with the head)."""
    if choice != "int4" or not has_rows:
        return None
    if qconfig is not None and qconfig.lm_head:
        return qconfig
    return QuantConfig(method="rtn", block=proposal_head_block(hidden, qconfig.block if qconfig else None))


def graph_weight_names(names: list[str], packed: dict[str, list[str]], draft_head: bool) -> list[str]:
    """The target graph's initializers for checkpoint weights `names`: packed parts (all quantized
    alike) by their packed name, plus the proposal head rows when `draft_head`."""
    chosen = set(names)
    out = [p for p, parts in packed.items() if set(parts) <= chosen]
    in_packs = {n for parts in packed.values() for n in parts}
    return out + [n for n in names if n not in in_packs] + (["draft_head"] if draft_head else [])


def read_packed(packed: dict[str, list[str]], readers: dict, source: WeightSource, dtype):
    """name -> weight `[N, K]` in `dtype` for a graph initializer: read from the shards, stacked for a
    packed one, or derived (the proposal head rows)."""
    def read(name):
        if name in packed:
            return torch.cat([source.read_as(part, dtype) for part in packed[name]], dim=0)
        return readers[name]() if name == "draft_head" else source.read_as(name, dtype)

    return read
