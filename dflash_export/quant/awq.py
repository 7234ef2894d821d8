"""Activation-aware INT4 scaling (AWQ) for dense Llama / Qwen3 targets: `build --quant int4 --quant-method awq`.

AWQ (Lin et al., 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys) protects the input channels that carry large activations: a linear layer's
weight columns are multiplied by a per-input-channel scale `s` before round-to-nearest and the
layer's input is divided by `s`, which is folded into the operator before it, so the full-precision
function is unchanged and no operator is added to the graph. Here that is a transform of the
checkpoint (`scaled_source`): the INT4 form, the RTN quantizer and the graph stay exactly as for
`--quant-method rtn`. Folding, per decoder layer (as the paper's reference implementation does):

- q/k/v read `input_layernorm`: its weight is divided by `s_attn` (one scale for the three);
- gate/up read `post_attention_layernorm`: its weight is divided by `s_mlp`;
- down reads `silu(gate) * up`: up's output rows (and bias) are divided by `s_down`;
- o reads the attention output: with as many kv heads as heads, v's rows are divided by `s_o`;
  grouped-query layers keep o unscaled (a v row feeds several heads' o columns).

Each scale is `mean|x|^alpha` over the calibration activations `x` of the layer input, normalised to
a geometric mean of 1 between its extremes, with alpha from a grid of `GRID` values in [0, 1) that
minimises the mean squared error of the quantized layer's output on those activations (alpha = 0 is
plain RTN, so the search never picks worse than RTN on its own data). Calibration runs the target one
decoder layer at a time on text of `models/prompts/train*.jsonl` in the target's chat template (one
layer's weights and the activations are held, never the whole model). Weight clipping, the paper's
second step, is not done.

The scales are stored in the artifact (`awq_scales.safetensors`), so `check` rebuilds the same
weights from the source checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from dflash_export.checkpoint.target import share_permissions
from dflash_export.checkpoint.weights import placeholder, set_parameter
from dflash_export.nn.tables import causal_bias, key_ones_for, rope_cos_sin, rope_matrix
from dflash_export.quant.rtn import dequantize, quantize_rtn
from runtime.errors import DFlashError

GRID = 20  # alphas 0, 0.05, ..., 0.95 (the paper's grid)
CALIBRATION_SEQUENCES = 4
CALIBRATION_LENGTH = 512  # tokens per sequence
SEARCH_ROWS = 1024  # activation rows the error is measured on (a seeded sample of all of them)
SCALES_FILE = "awq_scales.safetensors"
PROMPTS_DIR = Path(__file__).resolve().parents[2] / "models" / "prompts"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def check_calibration_source(target_dir: Path) -> None:
    """What `calibration_ids` needs, checked before `build` writes anything: the prompt files and, when
    the target has tokenizer files, a tokenizer that loads.

    Raises:
        DFlashError: naming the missing prompts or the unloadable tokenizer.
    """
    _tokenizer(Path(target_dir))


def has_tokenizer(target_dir: Path) -> bool:
    """Whether the target has tokenizer files (else calibration runs on seeded random ids)."""
    return any((Path(target_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _tokenizer(target_dir: Path):
    """The target's tokenizer, or None when it has no tokenizer files (calibrate on random ids).

    Raises:
        DFlashError: the prompt files are missing, or the tokenizer cannot be loaded.
    """
    if not has_tokenizer(target_dir):
        return None
    if not sorted(PROMPTS_DIR.glob("train*.jsonl")):
        raise DFlashError(f"--quant-method awq calibrates on {PROMPTS_DIR}/train*.jsonl, which is missing; "
                          "run from a checkout of the project or use --quant-method rtn")
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    except Exception as exc:  # transformers raises many types here
        raise DFlashError(f"cannot load the tokenizer of {target_dir} to calibrate AWQ: {exc}") from None


def calibration_ids(target_dir: Path, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """int64 `[CALIBRATION_SEQUENCES, CALIBRATION_LENGTH]` token ids to calibrate on: the training prompts
    of `models/prompts` (shuffled with `seed`), each in the target's chat template, run together. A
    target without a tokenizer calibrates on seeded random ids (its activations are then not those of
    text).

    Raises:
        DFlashError: the prompt files are missing (an install without `models/`), or the tokenizer
            cannot be loaded.
    """
    n = CALIBRATION_SEQUENCES * CALIBRATION_LENGTH
    tok = _tokenizer(Path(target_dir))
    if tok is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (CALIBRATION_SEQUENCES, CALIBRATION_LENGTH), generator=g)
    files = sorted(PROMPTS_DIR.glob("train*.jsonl"))
    texts = [json.loads(line)["prompt"] for f in files for line in f.read_text().splitlines() if line.strip()]
    texts = [texts[i] for i in torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed)).tolist()]
    ids: list[int] = []
    templated = isinstance(tok.chat_template, str)
    for text in texts:
        # a tokenizer with more ids than the embedding has rows (its added tokens): only the ids the
        # model can embed are kept
        ids += [i for i in _encode(tok, text, templated) if i < vocab_size]
        if len(ids) >= n:
            break
    if not ids:
        raise DFlashError(f"the tokenizer of {target_dir} gives no ids below the vocabulary size {vocab_size} for "
                          "the calibration prompts; use --quant-method rtn")
    if len(ids) < n:
        ids = (ids * (n // len(ids) + 1))[:n]
    return torch.tensor(ids[:n], dtype=torch.int64).view(CALIBRATION_SEQUENCES, CALIBRATION_LENGTH)


def _encode(tok, text: str, templated: bool) -> list[int]:
    """`text` as one user turn in the chat template, or as plain text when there is none or the template
    refuses a lone user turn (jinja raises its own error types)."""
    if templated:
        try:
            return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
        except Exception:
            pass
    return list(tok.encode(text + "\n"))


def search_scale(x: torch.Tensor, weights: list[torch.Tensor], block: int, dtype: torch.dtype,
                 rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The AWQ scale of the input channels of `weights` (each `[N_i, K]`, fp32) reading `x [T, K]` (fp32).

    Args:
        rows: int64 indices of the rows of `x` the output error is measured on.
        block, dtype: the INT4 block and scale dtype of `quant.int4.quantize_rtn`.

    Returns:
        (fp32 `[K]` scale, the alpha chosen).
    """
    w = torch.cat(weights)
    xs = x[rows]
    ref = xs @ w.T
    x_mean = x.abs().mean(0).clamp(min=1e-6)
    best = (float("inf"), torch.ones_like(x_mean), 0.0)
    for step in range(GRID):
        alpha = step / GRID
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        wq = dequantize(*quantize_rtn(w * s, block, dtype), block).to(torch.float32) / s
        err = float(((xs @ wq.T - ref) ** 2).mean())
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def calibrate(module, source, ids: torch.Tensor, block: int, dtype: torch.dtype, progress=None) -> dict[str, torch.Tensor]:
    """Search every decoder layer's AWQ scales on `ids`.

    Args:
        module: an empty `nn.layers.TargetForExport` of the target (its layers receive their weights here,
            one layer at a time, in fp32, and are emptied again).
        source: the target's `weights.WeightSource`.
        ids: int64 `[B, S]` calibration sequences (`calibration_ids`).
        block, dtype: the INT4 block and graph dtype.
        progress: called with (layer index, number of layers) after each layer, if given.

    Returns:
        fp32 scales by name: `model.layers.i.attn` `[d]`, `.mlp` `[d]`, `.down` `[intermediate]`, and
        `.o` `[H * D]` for layers with as many kv heads as heads.
    """

    a = module.spec.arch
    s_len = ids.shape[1]
    cos, sin = rope_cos_sin(torch.arange(s_len), module.inv_freq, module.rope_scale)
    rot = rope_matrix(cos, sin)
    attn0 = module.model.layers[0].self_attn
    tables = ((rot * attn0.scale, None), (rot, None))
    causal, ones = causal_bias(s_len, a.num_heads // a.num_kv_heads), key_ones_for(0, s_len)
    empty_kv = torch.zeros(0, a.num_kv_heads, a.head_dim)
    embed = source.read("model.embed_tokens.weight")
    hidden = [embed[seq].to(torch.float32) for seq in ids]
    del embed
    sample = torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(0))[:SEARCH_ROWS]
    scales = {}
    for i, layer in enumerate(module.model.layers):
        names = [n for n, _ in layer.named_parameters()]
        for n in names:
            set_parameter(layer, n, source.read_as(f"model.layers.{i}.{n}", torch.float32))
        inputs, hidden = _layer_inputs_and_outputs(layer, hidden, tables, empty_kv, causal, ones)
        at, mlp = layer.self_attn, layer.mlp
        p = f"model.layers.{i}."
        scales[p + "attn"], _ = search_scale(inputs["attn"], [at.q_proj.weight, at.k_proj.weight, at.v_proj.weight],
                                             block, dtype, sample)
        if at.num_heads == at.num_kv_heads:
            scales[p + "o"], _ = search_scale(inputs["o"], [at.o_proj.weight], block, dtype, sample)
        scales[p + "mlp"], _ = search_scale(inputs["mlp"], [mlp.gate_proj.weight, mlp.up_proj.weight], block, dtype, sample)
        scales[p + "down"], _ = search_scale(inputs["down"], [mlp.down_proj.weight], block, dtype, sample)
        for n, t in layer.named_parameters():
            set_parameter(layer, n, placeholder(t.shape, t.dtype))
        if progress is not None:
            progress(i + 1, len(module.model.layers))
    return scales


def _layer_inputs_and_outputs(layer, hidden: list[torch.Tensor], tables, empty_kv, causal, ones) -> tuple:
    """One pass of the layer over each sequence: (fp32 `[B * S, K]` inputs of its q (attn), o, gate (mlp)
    and down projections, by those names; its output hidden states, the next layer's input). The
    scales are searched on the unscaled weights, whose output is the scaled model's too."""
    seen: dict[str, list[torch.Tensor]] = {"attn": [], "o": [], "mlp": [], "down": []}
    hooks = [lin.register_forward_pre_hook(lambda mod, args, key=key: seen[key].append(args[0].reshape(-1, args[0].shape[-1])))
             for key, lin in (("attn", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                              ("mlp", layer.mlp.gate_proj), ("down", layer.mlp.down_proj))]
    try:
        with torch.no_grad():
            out = [layer(h, *tables, empty_kv, empty_kv, causal, ones)[0] for h in hidden]
    finally:
        for hook in hooks:
            hook.remove()
    return {k: torch.cat(v) for k, v in seen.items()}, out


# How each tensor of layer i takes the scales (the module docstring's folding): (scale its output rows
# (or a 1-D weight/bias) are divided by, scale its input columns are multiplied by).
_FOLDS = {
    "input_layernorm.weight": ("attn", None),
    "post_attention_layernorm.weight": ("mlp", None),
    "self_attn.q_proj.weight": (None, "attn"),
    "self_attn.k_proj.weight": (None, "attn"),
    "self_attn.v_proj.weight": ("o", "attn"),
    "self_attn.v_proj.bias": ("o", None),
    "self_attn.o_proj.weight": (None, "o"),
    "mlp.gate_proj.weight": (None, "mlp"),
    "mlp.up_proj.weight": ("down", "mlp"),
    "mlp.up_proj.bias": ("down", None),
    "mlp.down_proj.weight": (None, "down"),
}


def scaled_source(source, scales: dict[str, torch.Tensor]):
    """`source` with the AWQ scales applied (module docstring): the full-precision function is the same;
    the transformed tensors read as fp32, the rest as stored.

    Raises:
        DFlashError: `scales` lack a layer's scale, or one's size or values do not fit the checkpoint
            (a scales file from another artifact or damaged).
    """
    scales = _checked_scales(source, scales)

    def transform(name: str, t: torch.Tensor) -> torch.Tensor:
        m = _LAYER.match(name)
        fold = _FOLDS.get(m.group(2)) if m else None
        if fold is None:
            return t
        p = f"model.layers.{m.group(1)}."
        rows, cols = (scales.get(p + key) if key else None for key in fold)  # no "o" scale under GQA
        if rows is None and cols is None:
            return t
        out = t.to(torch.float32)
        if rows is not None:
            out = out / (rows[:, None] if out.dim() == 2 else rows)
        return out * cols if cols is not None else out

    return source.mapped(transform, "AWQ-scaled")


def _checked_scales(source, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp32 scales, each one present for every layer of `source` with the size its projections read."""
    layers = sorted({int(m.group(1)) for n in source.names() if (m := _LAYER.match(n))})
    bad = "the AWQ scales do not fit this checkpoint ({}); rebuild the artifact"
    out = {}
    for i in layers:
        p = f"model.layers.{i}."
        want = {"attn": source.shapes[p + "input_layernorm.weight"][0], "mlp": source.shapes[p + "post_attention_layernorm.weight"][0],
                "down": source.shapes[p + "mlp.down_proj.weight"][1]}
        if p + "o" in scales:
            want["o"] = source.shapes[p + "self_attn.o_proj.weight"][1]
        for key, size in want.items():
            s = scales.get(p + key)
            if s is None or tuple(s.shape) != (size,):
                raise DFlashError(bad.format(f"{p + key}: {'missing' if s is None else tuple(s.shape)}, expected ({size},)"))
            s = s.to(torch.float32)
            if not bool(torch.isfinite(s).all() and (s > 0).all()):
                raise DFlashError(bad.format(f"{p + key} has values that are not finite and positive"))
            out[p + key] = s
    return out


def save_scales(path: Path, scales: dict[str, torch.Tensor]) -> None:
    """Write the scales (fp32) as safetensors (into a build's temporary directory)."""
    from safetensors.torch import save_file


    save_file({k: v.to(torch.float32).contiguous() for k, v in scales.items()}, str(path))
    share_permissions(path)


def load_scales(path: Path) -> dict[str, torch.Tensor]:
    """The scales `save_scales` wrote.

    Raises:
        DFlashError: the file is missing or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise DFlashError(f"cannot read the AWQ scales {path} ({exc}); rebuild the artifact") from None
