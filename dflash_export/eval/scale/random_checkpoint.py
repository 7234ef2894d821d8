"""Random-weight Hugging Face checkpoints with the shapes of real Qwen3 targets, written in bounded memory.

Export memory and decode speed are measured at real scale on these (`export_memory`, `bench`,
`scripts/peer_bench.py`) without downloading any weights. Tensors are written one at a time, in chunks of
rows, into safetensors shards laid out as `save_pretrained` lays out a large model, so memory stays far
below the checkpoint's size. A copied tokenizer lets the artifacts take text; without one, token ids only.

    python scripts/make_random_checkpoint.py OUT --shape qwen3-1.7b [--dtype bf16] [--seed 0] [--tokenizer embedded]
    python scripts/make_random_checkpoint.py OUT --shape custom --hidden 1024 --layers 8 ...
    python scripts/make_random_checkpoint.py OUT --shape qwen3-8b --dflash2-draft DRAFT_DIR  # + a DFlash 2 draft
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from pathlib import Path

# Shapes of the released Qwen3 models (hidden, layers, heads, kv heads, head_dim, intermediate, tied).
SHAPES = {
    "qwen3-0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, tie=True),
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144, tie=True),
    "qwen3-4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, tie=True),
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288, tie=False),
}
QWEN3_VOCAB = 151936
# The released Qwen3.8-27B-DFlash2 draft (dflash2-notes: 5 layers, 32 / 8 heads of 128, intermediate 17408,
# sliding window 2048, block 8, selector rank 256 over the top 16, taps [5, 19, 33, 47, 61], mask 248070).
DFLASH2_DRAFT = dict(layers=5, heads=32, kv_heads=8, head_dim=128, block_size=8, rank=256, top_k=16, group=16,
                     kernel=2, window=2048, mask_token_id=248070, rope_theta=1e7)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
DTYPES = {"bf16": ("BF16", 2), "fp16": ("F16", 2), "fp32": ("F32", 4)}
CHUNK_ELEMENTS = 1 << 24  # rows are generated 16M values at a time (64 MB of fp32)


def tensor_shapes(hidden, layers, heads, kv_heads, head_dim, intermediate, tie, vocab=QWEN3_VOCAB) -> dict[str, tuple[int, ...]]:
    """Every weight of a Qwen3ForCausalLM in Hugging Face names and shapes, in checkpoint order."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not tie:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def dflash2_draft(hidden: int, intermediate: int, target_layers: int, vocab: int, d: dict = DFLASH2_DRAFT) -> tuple:
    """(shapes, config.json) of a released-format DFlash 2 draft (the 81-tensor layout for 5 layers) for a
    target of this width; taps spread over the target's layers as the released Qwen3.8-27B draft's."""
    shapes = {"candidate_selector.hidden_projection.weight": (d["rank"], hidden),
              "candidate_selector.predecessor_codebook": (vocab, d["rank"]),
              "candidate_selector.successor_codebook": (vocab, d["rank"]),
              "fc.weight": (hidden, 5 * hidden), "hidden_norm.weight": (hidden,)}
    for i in range(d["layers"]):
        p = f"layers.{i}."
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + conv + ".base_kernel"] = (2, d["kernel"], hidden)
            shapes[p + conv + ".kernel_projection.weight"] = (2 * d["kernel"] * hidden // d["group"], hidden)
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.down_proj.weight": (hidden, intermediate), p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "self_attn.k_norm.weight": (d["head_dim"],), p + "self_attn.q_norm.weight": (d["head_dim"],),
            p + "self_attn.q_proj.weight": (d["heads"] * d["head_dim"], hidden),
            p + "self_attn.k_proj.weight": (d["kv_heads"] * d["head_dim"], hidden),
            p + "self_attn.v_proj.weight": (d["kv_heads"] * d["head_dim"], hidden),
            p + "self_attn.o_proj.weight": (hidden, d["heads"] * d["head_dim"]),
        })
    shapes["norm.weight"] = (hidden,)
    first, last = max(1, round(5 * target_layers / 64)), target_layers - 3
    taps = [round(first + i * (last - first) / 4) for i in range(5)]  # 64 layers: [5, 19, 33, 47, 61]
    config = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
        "dflash_config": {"block_size": d["block_size"], "conv_group_size": d["group"], "conv_kernel_size": d["kernel"],
                          "mask_token_id": d["mask_token_id"], "selector_rank": d["rank"], "selector_top_k": d["top_k"],
                          "target_layer_ids": taps},
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "head_dim": d["head_dim"],
        "layer_types": ["sliding_attention"] * d["layers"], "sliding_window": d["window"], "use_sliding_window": True,
        "num_target_layers": target_layers, "rms_norm_eps": 1e-6, "vocab_size": vocab, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": d["rope_theta"]}, "torch_dtype": "bfloat16",
    }
    return shapes, config


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shards(shapes: dict, itemsize: int, shard_bytes: int) -> list[list[str]]:
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = _numel(shape) * itemsize
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + ([current] if current else [])


def _write_tensor(fh, name: str, shape: tuple, dtype, gen) -> None:
    import torch

    if name.endswith("norm.weight"):
        fh.write(torch.ones(shape, dtype=dtype).numpy(force=True).tobytes() if dtype != torch.bfloat16
                 else torch.ones(shape, dtype=dtype).view(torch.int16).numpy().tobytes())
        return
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(1, _numel(shape[1:])))
    for start in range(0, shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, shape[0] - start)
        chunk = (torch.randn((rows, *shape[1:]), generator=gen) * 0.02).to(dtype)
        raw = chunk.view(torch.int16) if dtype == torch.bfloat16 else chunk
        fh.write(raw.numpy().tobytes())


def write_checkpoint(out: Path, shapes: dict, dtype: str, seed: int, shard_gib: float, config: dict) -> int:
    """Write `shapes` as random safetensors shards + index + config into `out`; returns bytes of weights.
    Weights are normal(0, 0.02), norm weights 1."""
    import torch

    st_dtype, itemsize = DTYPES[dtype]
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(seed)
    shards = _shards(shapes, itemsize, int(shard_gib * (1 << 30)))
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            nbytes = _numel(shapes[name]) * itemsize
            header[name] = {"dtype": st_dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        tmp = out / f".{fname}.partial"
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(blob)))
            fh.write(blob)
            for name in names:
                _write_tensor(fh, name, shapes[name], torch_dtype, gen)
        os.replace(tmp, out / fname)
        total += offset
        print(f"  {fname}: {len(names)} tensors, {offset / (1 << 30):.2f} GiB", file=sys.stderr, flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total


def qwen3_config(hidden, layers, heads, kv_heads, head_dim, intermediate, tie, vocab=QWEN3_VOCAB, dtype="bf16") -> dict:
    """A Qwen3ForCausalLM config.json for these sizes (Qwen3's released RoPE, norm eps and special ids)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": vocab, "tie_word_embeddings": tie, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype],
    }


def tokenizer_source(source: str, vocab: int) -> Path:
    """The directory to copy tokenizer files from: "embedded" (the embedded SmolLM2's, whose 49k ids lie
    inside Qwen3's vocabulary) or a Hugging Face directory, checked before any weight is written. Raises SystemExit when it has no readable
    tokenizer, or one with more ids than the checkpoint's `vocab`."""
    if source == "embedded":
        from dflash_export.checkpoint.sources import embedded_target_dir
        from runtime.errors import DFlashError

        try:
            src = embedded_target_dir()
        except DFlashError as exc:
            raise SystemExit(f"make_random_checkpoint: {exc}") from None
    else:
        src = Path(source)
    if not (src / "tokenizer.json").is_file():
        raise SystemExit(f"make_random_checkpoint: no tokenizer.json in {src}; pass --tokenizer embedded or a "
                         "Hugging Face directory that has one")
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size()
    except Exception as exc:  # tokenizers raises its own untyped errors
        raise SystemExit(f"make_random_checkpoint: {src / 'tokenizer.json'} cannot be read ({exc})") from None
    if size > vocab:
        raise SystemExit(f"make_random_checkpoint: the tokenizer has {size} ids but --vocab is {vocab}; "
                         f"pass --vocab {size} or more")
    return src


def copy_tokenizer(src: Path, out: Path) -> list[str]:
    """Copy the tokenizer and chat-template files of `src` into `out`; returns the names copied."""
    import shutil

    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copyfile(src / name, out / name)
    return copied


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Command line (`scripts/make_random_checkpoint.py`); returns the exit status."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="directory to create")
    p.add_argument("--shape", choices=[*SHAPES, "custom"], required=True)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gib", type=float, default=4.0, help="largest shard (default 4 GiB)")
    for flag in ("hidden", "layers", "heads", "kv-heads", "head-dim", "intermediate"):
        p.add_argument(f"--{flag}", type=int, help="custom shape (with --shape custom)")
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    p.add_argument("--dflash2-draft", type=Path, metavar="DIR",
                   help="also write a random DFlash 2 draft of the released layout (Qwen3.8-27B-DFlash2's) for it")
    p.add_argument("--tie", action="store_true", help="custom shape: tie the LM head to the embedding")
    p.add_argument("--tokenizer", help="'embedded' (SmolLM2's files) or a Hugging Face directory to copy a "
                                       "tokenizer and chat template from (default: none, token ids only)")
    args = p.parse_args(argv)
    if args.shape == "custom":
        dims = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, intermediate=args.intermediate, tie=args.tie)
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            p.error(f"--shape custom needs {', '.join('--' + m.replace('_', '-') for m in missing)}")
    else:
        dims = SHAPES[args.shape]
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in dims.items() if k != "tie" and v < 1]
    bad += [f"--vocab {args.vocab}"] * (args.vocab < 1) + [f"--shard-gib {args.shard_gib}"] * (args.shard_gib <= 0)
    if bad:
        p.error(f"{', '.join(bad)}: sizes must be positive")
    if dims["heads"] % dims["kv_heads"]:
        p.error(f"--heads {dims['heads']} is not a multiple of --kv-heads {dims['kv_heads']}")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        p.error(f"{args.out} exists and is not an empty directory; choose a new directory")
    tok_src = tokenizer_source(args.tokenizer, args.vocab) if args.tokenizer else None
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"cannot create {args.out} ({exc.strerror or exc}); choose a writable directory")
    t0 = time.perf_counter()
    shapes = tensor_shapes(**dims, vocab=args.vocab)
    total = write_checkpoint(args.out, shapes, args.dtype, args.seed, args.shard_gib,
                             qwen3_config(**dims, vocab=args.vocab, dtype=args.dtype))
    if args.dflash2_draft is not None:
        dshapes, dconfig = dflash2_draft(dims["hidden"], dims["intermediate"], dims["layers"], args.vocab)
        dtotal = write_checkpoint(args.dflash2_draft, dshapes, "bf16", args.seed + 1, 1 << 10, dconfig)
        print(f"wrote the DFlash 2 draft {args.dflash2_draft}: {len(dshapes)} tensors, {dtotal / (1 << 30):.2f} GiB bf16",
              file=sys.stderr)
    if tok_src is not None:
        copy_tokenizer(tok_src, args.out)
    params = sum(_numel(s) for s in shapes.values())
    print(f"wrote {args.out}: {params / 1e9:.2f}B parameters, {total / (1 << 30):.2f} GiB {args.dtype}, "
          f"in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0
