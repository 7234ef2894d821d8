"""Target families behind one small registry: what `build` and `check` ask of a family, in one place.

A family is one module (`dense_target`: Qwen3 and Llama; `qwen3_5_target`: the Qwen3.5/3.6 Gated
DeltaNet hybrid) sharing the common layers of `modules.py`, naming its export step in `EXPORT_TITLE`
(build's progress line) and providing five hooks:

- `check_weights(tspec, tap_layers, source)`: every parameter the export module needs has a checkpoint
  tensor of its shape, before any output exists (raises DFlashError naming what is wrong);
- `check_options(tspec, tap_layers, source, qconfig, proposal_head)`: refuses `build` options the family
  cannot honour (an INT4 block that does not divide a layer, an option it lacks), before any output;
- `export_for_build(tspec, dspec, source, path, dtype, qconfig, proposal_head, quiet)`: writes the
  target graph at `path` and returns an :class:`ExportedTarget`;
- `reference_target(tspec, dspec, source, manifest, vocab)`: the fp32 PyTorch module `check` compares
  the graph with (INT4 artifacts: over the dequantized weights the graph computes with);
- `manifest_fields(tspec)`: the family's extra fields of `manifest["target"]` (what the runtime reads).

The family name comes from `checkpoint.load_target_spec` (`TargetSpec.family`, also the manifest's
`family`). A new family is its export module, its config reader in `load_target_spec` (see
`hybrid_spec.py`) and one line in FAMILIES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

# family name (TargetSpec.family) -> the module implementing its hooks
FAMILIES = {"qwen3": "dense_target", "llama": "dense_target", "qwen3_5": "qwen3_5_target"}


@dataclass
class ExportedTarget:
    """What a family's `export_for_build` hands back to `build` besides the graph it wrote.

    mask_row: fp32 numpy `[d]`, the target embedding row of the draft's mask token.
    quantized: names of the checkpoint weights stored INT4 in the graph (empty without --quant).
    proposal_head: the INT4 config of the proposal head rows (`--proposal-head int4`), or None.
    quant_extra: fields for the manifest's `quantization` record (AWQ's scales file and calibration).
    """

    mask_row: Any
    quantized: list[str] = field(default_factory=list)
    proposal_head: Any = None
    quant_extra: dict = field(default_factory=dict)


def target_family(name: str) -> ModuleType:
    """The module implementing family `name`'s hooks (imported on first use).

    Raises:
        KeyError: `name` is no registered family (load_target_spec only returns registered ones).
    """
    return importlib.import_module(f".{FAMILIES[name]}", __package__)
