"""Draft families: what `build` asks of a draft format, in one place (the target side is
`dflash_export.families.registry`).

A draft family is one module naming the `ARCHITECTURES` its checkpoints declare and providing:

- `read_draft(draft_dir, tspec)`: (DraftSpec, state dict) of a checkpoint for target `tspec`
  (raises DFlashError naming what is wrong);
- `untrained_draft(tspec)`: (DraftSpec, state dict) of a deterministic random draft for `tspec`
  (a target without a released draft: the output stays exact, few proposals are accepted);
- `export_for_build(...)`: writes the draft graph and returns an :class:`ExportedDraft`; a family with
  `BATCHES = True` also takes `batched_path` (`build --batched`: the batched draft graph).

A new family is its module and one line in DRAFT_FAMILIES.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from dflash_export.checkpoint.target import TargetSpec, read_config
from runtime.errors import DFlashError

# architecture (config.json `architectures`) -> the module implementing its hooks
DRAFT_FAMILIES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
DEFAULT_DRAFT_FAMILY = "dflash"  # a draft config without `architectures` (older DFlash releases)


@dataclass
class ExportedDraft:
    """What a draft family's `export_for_build` hands back to `build` besides the graph it wrote.

    head_config: the INT4 config of the proposal head rows in the draft graph, or None.
    quant_plan: the manifest's record of the draft's INT4 layers (None: none are INT4).
    batched: the batched draft graph was written too (asked for, and the family and draft have one).
    """

    head_config: Any = None
    quant_plan: dict | None = None
    batched: bool = False


def draft_family(name: str) -> ModuleType:
    """The module implementing draft family `name`'s hooks (a value of DRAFT_FAMILIES)."""
    return importlib.import_module(f".{name}", __package__)


def family_of(draft_dir: Path) -> ModuleType:
    """The draft family of the checkpoint at `draft_dir`, from its config's `architectures`.

    Raises:
        DFlashError: no config.json, or an architecture no draft family takes.
    """
    cfg_path = Path(draft_dir) / "config.json"
    if not cfg_path.is_file():  # the family reads the directory and names what is missing
        return draft_family(DEFAULT_DRAFT_FAMILY)
    archs = read_config(Path(draft_dir)).get("architectures") or []
    known = [DRAFT_FAMILIES[a] for a in archs if a in DRAFT_FAMILIES]
    if archs and not known:
        raise DFlashError(f"draft {draft_dir} declares architectures {archs}; supported drafts: "
                          f"{', '.join(DRAFT_FAMILIES)}")
    if len(set(known)) > 1:
        raise DFlashError(f"draft {draft_dir} declares architectures {archs}, of more than one draft family; "
                          "keep the one its weights are")
    return draft_family(known[0] if known else DEFAULT_DRAFT_FAMILY)


def load_draft(draft_dir: Path | None, tspec: TargetSpec) -> tuple[ModuleType, Any, dict]:
    """(family module, DraftSpec, state dict) of the draft at `draft_dir` for target `tspec`, or of the
    default family's untrained draft when `draft_dir` is None.

    Raises:
        DFlashError: see :func:`family_of` and the family's `read_draft`.
    """
    if draft_dir is None:
        family = draft_family(DEFAULT_DRAFT_FAMILY)
        return family, *family.untrained_draft(tspec)
    family = family_of(draft_dir)
    return family, *family.read_draft(Path(draft_dir), tspec)
