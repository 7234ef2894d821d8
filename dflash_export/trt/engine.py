"""TensorRT engines (`target.plan`, `draft.plan`) for an exported artifact, built on the device.

Needs TensorRT (10.x or 11.x) and an NVIDIA GPU; never torch. Run it where the engines will run
(TensorRT engines are tied to the TensorRT version and the GPU that built them):

    python -m dflash_export build --target T --out DIR --engine trt [--precision fp16]   # export + engines
    python -m dflash_export engine DIR [--precision fp16]                              # engines for an existing DIR

Profiles: one list per graph from `runtime.backends.profiles.shape_ranges` (the same function the runtime
and the tests use): target "prefill", "verify" and "extend", draft "draft_prefill" and "draft_step",
up to the manifest's max_seq_len. A timing cache (`timing.cache`) is kept in the artifact so a rebuild
on the same device skips kernel timing.

Hybrid artifacts (Qwen3.5, Gated DeltaNet layers): the same three target profiles, with each GDN
layer's static state inputs (conv state, fp32 recurrent state) at their exported shapes, its pending
rows in [0, max_call_rows] (0 at prefill), and T + N <= max_call_rows (64) at every profile corner
(see `runtime.backends.profiles`). Only strongly typed builds of them are made (the table below): the fp32
recurrent state and the delta rule's fp32 math are then exactly the exported types, and the engine's
`recurrent_state_i` / `recurrent_state_out_i` IO is fp32 also in an fp16 engine, as the manifest says.

Written against TensorRT's documented Python API (10.3 through 11.x: `Builder`, `OnnxParser`,
`create_optimization_profile` / `set_shape`, `build_serialized_network`, timing caches) and, in this
repository, run only through the test double (tests/test_trt_backend_double.py,
tests/test_trt_hybrid_double.py), never on TensorRT itself.

Precision (what is built, per TensorRT major version and ONNX dtype):

| ONNX (`build --dtype`) | `--precision` | TensorRT 10 | TensorRT 11 |
|---|---|---|---|
| fp16 | fp16 | strongly typed: exactly the exported types (fc, norms, softmax, RoPE fp32) | same |
| fp32 | fp32 | fp32, TF32 off | strongly typed fp32 |
| fp32 | fp16 / bf16 | weakly typed (BuilderFlag.FP16/BF16), layers of `fc` and every RMSNorm pinned to fp32 (OBEY_PRECISION_CONSTRAINTS; found from the ONNX node metadata, needs `onnx`) | refused: TensorRT 11 is strongly typed only, re-export with `--dtype fp16` |
| fp16 | fp32 / bf16 | refused (the graph already carries fp16) | refused |

A hybrid (Gated DeltaNet) target's fp32 graphs build only as fp32 engines: a weakly typed fp16/bf16
build would let TensorRT run the delta rule and its decay (`exp(A_log)` reaches 9e6, beyond fp16) in
fp16, with errors compounding in the recurrent state; re-export with `--dtype fp16`, whose graph keeps
those parts fp32 (strongly typed).

So for TensorRT 11 we REQUIRE an fp16 ONNX export (`build --dtype fp16`) rather than deriving one:
the exporter already places the fp32 islands (fc, norms, softmax, RoPE, logits) where they belong.

The manifest gains a "trt" section: TensorRT version, GPU name and compute capability, precision,
typing mode, plan files, profiles; it is replaced atomically (write + rename) after both plans are
in place.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from runtime.backends.profiles import max_block, profiles_to_json, shape_ranges
from runtime.backends.trt import gpu_info, import_tensorrt
from runtime.errors import DFlashError
from runtime.files import write_atomic
from runtime.manifest import (
    BATCHED_GRAPH,
    DEFAULT_MAX_BATCH,
    DEFAULT_PREFILL_CHUNK,
    is_hybrid,
    load_manifest,
)

PRECISIONS = ("fp16", "bf16", "fp32")
TIMING_CACHE = "timing.cache"


def require_tensorrt(precision: str | None = None, dtype: str | None = None, exporting: bool = True,
                     hybrid: bool = False):
    """Fail at once, naming everything missing, when engines cannot be built here.

    Args:
        precision, dtype: when given, also refuse a precision/ONNX dtype pair that this TensorRT
            cannot build (see :func:`precision_plan`) before any export starts.
        exporting: called by `build --engine trt` (the advice is to export here and build engines on
            the device) rather than by `engine DIR` (the advice is to run it on the device).
        hybrid: the target is a hybrid (Gated DeltaNet) one (see :func:`precision_plan`).

    Returns:
        (tensorrt module, {"name", "compute_capability"} of the GPU).

    Raises:
        DFlashError: TensorRT and/or a GPU is missing (both are named when both are).
    """
    missing = []
    trt = None
    try:
        trt = import_tensorrt()
    except DFlashError as exc:
        missing.append(str(exc))
    gpu, why = gpu_info()
    if gpu is None:
        missing.append(f"an NVIDIA GPU: {why}")
    if missing:
        raise DFlashError(
            "building TensorRT engines needs TensorRT and an NVIDIA GPU on this machine; missing: "
            + "; ".join(missing)
            + (". Export here without --engine trt, copy the artifact to the device, and run "
               "`python -m dflash_export engine DIR` there (see docs/jetson.md)" if exporting else
               ". Run this command on the device that will run the engines (e.g. the Jetson; see docs/jetson.md); "
               "here the artifact's ONNX graphs run with --backend ort")
        )
    if precision is not None and dtype is not None:
        precision_plan(str(trt.__version__), dtype, precision, hybrid=hybrid)
    return trt, gpu


def trt_major(version: str) -> int:
    """Major version of a TensorRT version string ("10.3.0.30" -> 10)."""
    try:
        return int(str(version).split(".")[0])
    except ValueError:
        raise DFlashError(f"cannot read the TensorRT version {version!r}") from None


def precision_plan(trt_version: str, onnx_dtype: str, precision: str, hybrid: bool = False) -> dict:
    """How to build `precision` engines from an `onnx_dtype` graph on this TensorRT (table in the module doc).

    `hybrid`: the target has Gated DeltaNet layers; a weakly typed fp16/bf16 build of its fp32 graphs
    is refused (the module doc says why).

    Returns:
        {"strongly_typed": bool, "flag": None | "FP16" | "BF16", "pin_fp32": bool, "tf32": bool}.

    Raises:
        DFlashError: an unsupported combination, with the fix.
    """
    if precision not in PRECISIONS:
        raise DFlashError(f"--precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
    major = trt_major(trt_version)
    if major < 10:
        raise DFlashError(f"TensorRT {trt_version} is too old: the engines need TensorRT 10 or newer (JetPack 6+)")
    if onnx_dtype == "fp16":
        if precision != "fp16":
            raise DFlashError(
                f"the artifact's ONNX graphs are fp16; a {precision} engine needs an fp32 export: "
                "rebuild with `build --dtype fp32`"
            )
        return {"strongly_typed": True, "flag": None, "pin_fp32": False, "tf32": False}
    if precision == "fp32":
        return {"strongly_typed": major >= 11, "flag": None, "pin_fp32": False, "tf32": False}
    if hybrid:
        raise DFlashError(
            f"this artifact's hybrid (Gated DeltaNet) target has fp32 graphs: a {precision} engine from them would be "
            "weakly typed, and TensorRT could then run the delta rule and its recurrent state in reduced precision "
            "(exp(A_log) overflows fp16). Re-export with `python -m dflash_export build --dtype fp16 ...` (the graph "
            "keeps the state math fp32; strongly typed build), or build `--precision fp32` engines"
        )
    if major >= 11:
        raise DFlashError(
            f"TensorRT {trt_version} builds strongly typed networks only, so the ONNX must already carry {precision}; "
            f"this artifact's graphs are fp32. Re-export with `python -m dflash_export build --dtype fp16 ...`"
            + (" (bf16 graphs are not exported; use fp16)" if precision == "bf16" else "")
        )
    return {"strongly_typed": False, "flag": precision.upper(), "pin_fp32": True, "tf32": False}


def fp32_onnx_values(onnx_path: Path) -> set[str]:
    """Names of the ONNX values computed inside the draft's `fc` or any RMSNorm (from the exporter's
    node metadata), i.e. the layers a weakly typed fp16/bf16 build must keep in fp32.

    Raises:
        DFlashError: the `onnx` package is missing.
    """
    try:
        import onnx
    except ImportError:
        raise DFlashError(
            "a weakly typed fp16/bf16 build from fp32 graphs needs the `onnx` package to find the fc/norm layers "
            "to keep in fp32: pip install onnx, or export with --dtype fp16 (recommended)"
        ) from None
    model = onnx.load(str(onnx_path), load_external_data=False)
    names: set[str] = set()
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        hierarchy = meta.get("pkg.torch.onnx.class_hierarchy", "")
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            scopes = []
        if "RMSNorm" in hierarchy or (len(scopes) > 1 and scopes[1] == "fc"):
            names.update(o for o in node.output if o)
    return names


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _network(trt, builder, onnx_path: Path, plan: dict, config, logger, quiet: bool):
    flags = 0
    if plan["strongly_typed"]:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise DFlashError(f"TensorRT's ONNX parser rejected {onnx_path.name}: " + " | ".join(errors[:5]))
    if plan["flag"]:
        config.set_flag(getattr(trt.BuilderFlag, plan["flag"]))
    if not plan["strongly_typed"] and not plan["tf32"] and hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 means fp32 (TF32 would cost ~1e-3 relative error)
    pinned = 0
    if plan["pin_fp32"]:
        keep = fp32_onnx_values(onnx_path)
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            outs = [layer.get_output(j) for j in range(layer.num_outputs)]
            if any(o is not None and o.name in keep for o in outs):
                layer.precision = trt.float32
                for j, o in enumerate(outs):
                    if o is not None and o.dtype in (trt.float32, trt.float16, getattr(trt, "bfloat16", trt.float16)):
                        layer.set_output_type(j, trt.float32)
                pinned += 1
        _log(f"  {onnx_path.name}: {pinned} layers of fc/RMSNorm pinned to fp32", quiet)
    return network, parser, pinned


def build_engines(
    artifact_dir: str | Path,
    precision: str = "fp16",
    max_block_size: int | None = None,
    workspace_mib: int | None = None,
    quiet: bool = False,
    trt=None,
    gpu: dict | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
) -> dict:
    """Build `target.plan` and `draft.plan` (and `target_batched.plan` where the artifact has the batched
    graph) for an artifact and record them in its manifest.

    Args:
        artifact_dir: an artifact written by `build` (its ONNX graphs and manifest).
        precision: "fp16" (default), "bf16" or "fp32" (see the module doc for what each builds).
        max_block_size: largest block the engines accept (default: the runtime's, max(64, block size)).
        workspace_mib: TensorRT workspace limit (default: TensorRT's, the device memory).
        trt, gpu: the tensorrt module and GPU description (default: the real ones; tests pass doubles).
        max_batch, prefill_chunk: the batched engine's slots and prefill rows per sequence
            (`profiles.batched_dim_ranges`; `runtime.batching.BatchEngine` must use the same max_batch).

    Returns:
        the updated manifest.

    Raises:
        DFlashError: TensorRT/GPU missing, an unsupported precision, a parse or build failure.
            On failure the artifact keeps its previous plans and manifest.
    """
    out = Path(artifact_dir)
    manifest = load_manifest(out)
    if trt is None or gpu is None:
        real_trt, real_gpu = require_tensorrt(exporting=False)
        trt, gpu = trt or real_trt, gpu or real_gpu
    version = str(trt.__version__)
    hybrid = is_hybrid(manifest)
    plan = precision_plan(version, manifest["dtype"], precision, hybrid=hybrid)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise DFlashError(f"--max-batch must be a positive integer (got {max_batch!r})")
    ranges = shape_ranges(manifest, max_block_size, max_batch, prefill_chunk)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    cache_path = out / TIMING_CACHE
    cache_blob = cache_path.read_bytes() if cache_path.is_file() else b""
    cache = None
    tmp_files: dict[str, Path] = {}
    plans = {graph: f"{graph}.plan" for graph in ranges}
    info: dict[str, dict] = {}
    try:
        for graph in plans:
            t0 = time.perf_counter()
            _log(f"building {plans[graph]} ({precision}, TensorRT {version}, {gpu['name']}) ...", quiet)
            config = builder.create_builder_config()
            if cache is None:
                cache = config.create_timing_cache(cache_blob)
            config.set_timing_cache(cache, False)
            if workspace_mib:
                config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mib) << 20)
            network, _parser, pinned = _network(trt, builder, out / manifest[graph]["graph"], plan, config, logger, quiet)
            for prof in ranges[graph]:
                p = builder.create_optimization_profile()
                for name, (lo, opt, hi) in prof.shapes.items():
                    p.set_shape(name, lo, opt, hi)
                config.add_optimization_profile(p)
            blob = builder.build_serialized_network(network, config)
            if blob is None:
                raise DFlashError(
                    f"TensorRT could not build {plans[graph]} (its log above says why). If it refuses a profile whose "
                    "minimum is 0 (empty past / no proposals), see docs/jetson.md, 'Zero-length dimensions'"
                )
            fd, name = tempfile.mkstemp(prefix=f".{plans[graph]}.", dir=out)
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(blob))
            tmp_files[graph] = Path(name)
            info[graph] = {"seconds": round(time.perf_counter() - t0, 1), "bytes": tmp_files[graph].stat().st_size,
                           "fp32_pinned_layers": pinned}
            _log(f"  {plans[graph]}: {info[graph]['bytes'] / 2**20:.1f} MiB in {info[graph]['seconds']}s", quiet)
        for graph, tmp in tmp_files.items():
            os.replace(tmp, out / plans[graph])
        tmp_files = {}
        write_atomic(cache_path, bytes(memoryview(cache.serialize())))
        manifest["trt"] = {
            "tensorrt_version": version,
            "gpu": {"name": gpu["name"], "compute_capability": gpu["compute_capability"]},
            "precision": precision,
            "onnx_dtype": manifest["dtype"],
            "strongly_typed": plan["strongly_typed"],
            "builder_flag": plan["flag"],
            "plans": plans,
            "timing_cache": TIMING_CACHE,
            "max_block": int(max_block_size or max_block(manifest)),
            **({"max_batch": max_batch, "prefill_chunk": prefill_chunk} if BATCHED_GRAPH in plans else {}),
            "profiles": profiles_to_json(ranges),
            "build": info,
        }
        write_atomic(out / "manifest.json", json.dumps(manifest, indent=2).encode())
    finally:
        for tmp in tmp_files.values():
            tmp.unlink(missing_ok=True)
    return manifest


# ---- command line ----------------------------------------------------------------------------------
def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="artifact directory written by `python -m dflash_export build`")
    p.add_argument("--precision", choices=PRECISIONS, default="fp16", help="engine precision (default fp16)")
    p.add_argument("--max-block", type=int, default=None, help="largest block size the engines accept (default max(64, draft block))")
    p.add_argument("--workspace-mib", type=int, default=None, help="TensorRT workspace limit in MiB")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"batched artifacts: sequences the batched engine serves at once (default {DEFAULT_MAX_BATCH}; "
                        "`serve --max-batch` must match)")


def cmd_engine(args) -> int:
    m = build_engines(args.artifact, precision=args.precision, max_block_size=args.max_block, workspace_mib=args.workspace_mib,
                      max_batch=args.max_batch)
    t = m["trt"]
    print(f"wrote {Path(args.artifact).resolve()}/{{{','.join(t['plans'])}}}.plan ({t['precision']}, TensorRT {t['tensorrt_version']}, "
          f"{t['gpu']['name']} sm {t['gpu']['compute_capability']}, max_seq_len {m['max_seq_len']})")
    return 0


def register(subparsers) -> None:
    """Add the `engine` subcommand (engines for an existing artifact)."""
    p = subparsers.add_parser("engine", help="build TensorRT engines for an existing artifact (on the device)")
    _add_args(p)
    p.set_defaults(func=cmd_engine)


def main(argv: list[str] | None = None) -> int:
    """`python -m dflash_export engine DIR [--precision ...]` (also `python -m dflash_export.trt.engine`); exit status 2 on a user error."""
    p = argparse.ArgumentParser(prog="python -m dflash_export.trt.engine", description=__doc__.splitlines()[0])
    _add_args(p)
    args = p.parse_args(argv)
    try:
        return cmd_engine(args)
    except DFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
