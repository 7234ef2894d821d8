"""Target families behind one small registry: what `load_target_spec`, `build`, `check` and
`train-draft` ask of a family, in one place.

A family is one module (`families.dense`: Qwen3 and Llama; `families.qwen3_5`: the Qwen3.5/3.6 Gated
DeltaNet hybrid) sharing the common layers of `nn/layers.py`, naming its export step in `EXPORT_TITLE`
(build's progress line) and providing these hooks:

- `read_target(model_dir, cfg)`: the :class:`checkpoint.target.TargetSpec` of a checkpoint whose config.json
  (`cfg`) is the family's, None for another family's (raises DFlashError for the family's checkpoints
  it cannot take); `families.registry.load_target_spec` asks the families in FAMILIES order;
- `check_weights(tspec, tap_layers, source)`: every parameter the export module needs has a checkpoint
  tensor of its shape, before any output exists (raises DFlashError naming what is wrong);
- `check_options(tspec, tap_layers, source, qconfig, proposal_head)`: refuses `build` options the family
  cannot honour (an INT4 block that does not divide a layer, an option it lacks), before any output;
- `export_for_build(tspec, dspec, source, path, dtype, qconfig, proposal_head, quiet)`: writes the
  target graph at `path` and returns an :class:`ExportedTarget`;
- `reference_target(tspec, dspec, source, manifest, vocab)`: the fp32 PyTorch module `check` compares
  the graph with (INT4 artifacts: over the dequantized weights the graph computes with);
- `manifest_fields(tspec)`: the family's extra fields of `manifest["target"]` (what the runtime reads);
- `causal_lm_state_dict(state)`: a loaded checkpoint's tensors under the `*ForCausalLM` names
  `train-draft` reads (`model.layers.N.*`, `model.embed_tokens.weight`, `lm_head.weight`);
- `NORM_WEIGHT_OFFSET`: what to add to a stored RMSNorm weight to get the scale a draft norm uses
  (0.0; 1.0 where the family stores them zero-centred), for `train-draft --init target`.

The family name comes from the `read_target` that recognised the checkpoint (`TargetSpec.family`, also
the manifest's `family`). A new family is its module and one line in FAMILIES.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from dflash_export.checkpoint.target import TargetSpec, read_config
from runtime.errors import DFlashError

# family name (TargetSpec.family) -> the module implementing its hooks (load_target_spec asks them in this order)
FAMILIES = {"qwen3": "dense", "llama": "dense", "qwen3_5": "qwen3_5"}


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


def draft_proposes(vocab_proposes: bool, dspec, qconfig) -> bool:
    """Whether `build` ends the draft graph in the proposal head (`nn.draft.ProposingDraft`; the
    target graph then takes proposal ids): for a draft with a proposal vocabulary where the family
    takes it so (`vocab_proposes`: its `DRAFT_PROPOSES`), always for a draft family whose graph ranks
    its own proposals (`dspec.proposes_itself`: DFlash 2's selector), and always when the LM head is INT4
    (`qconfig.lm_head`). An INT4 head must have one MatMul per graph: onnxruntime fuses
    `DequantizeLinear -> MatMul` into MatMulNBits only when the INT4 initializer has that one
    consumer, and a target that ranked the draft's rows itself would use its head twice (proposals,
    then logits)."""
    int4_head = qconfig is not None and qconfig.lm_head
    return bool(int4_head or dspec.proposes_itself or (vocab_proposes and dspec.draft_vocab is not None))


def target_family(name: str) -> ModuleType:
    """The module implementing family `name`'s hooks (imported on first use).

    Raises:
        KeyError: `name` is no registered family (load_target_spec only returns registered ones).
    """
    return importlib.import_module(f".{FAMILIES[name]}", __package__)


def family_modules() -> Iterator[ModuleType]:
    """Every registered family's module, once each, in FAMILIES order (each imported only when reached)."""
    for name in dict.fromkeys(FAMILIES.values()):
        yield importlib.import_module(f".{name}", __package__)


def load_target_spec(model_dir: Path) -> TargetSpec:
    """Validate a target directory: the first registered family (`FAMILIES`, in order) whose
    `read_target` hook recognises its config reads it (Qwen3ForCausalLM, LlamaForCausalLM, a dense
    Qwen3.5/3.6 hybrid).

    Raises:
        DFlashError: unsupported architecture, sliding-window layers, missing fields or weights.
    """

    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    archs = cfg.get("architectures") or []
    if "DFlashDraftModel" in archs:  # its model_type is the target family's, so it would pass below
        raise DFlashError(f"{model_dir} is a DFlash draft, not a target; pass the target model as --target "
                          "(and the draft as --draft where the command takes one)")
    for family in family_modules():
        spec = family.read_target(model_dir, cfg)
        if spec is not None:
            return spec
    supported = [arch for family in family_modules() for arch in family.ARCHITECTURES]
    raise DFlashError(
        f"target {model_dir} has architectures {archs or cfg.get('model_type')}; supported: "
        f"{', '.join(supported)}"
    )
