"""onnxruntime backend: static host buffers bound by raw pointer through IO binding.

Past K/V inputs are bound as a prefix view of each layer's static buffer and the new K/V rows
are bound as outputs at row P of the same buffer, so onnxruntime writes them in place: no cache
copy, and rollback is a length update in the decoding loop.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from runtime.backends.base import ADDRESS_ALIGNMENT, Backend, Buffer, View
from runtime.errors import DFlashError
from runtime.manifest import (
    BATCHED_DRAFT_GRAPH,
    BATCHED_DRAFT_INPUTS,
    BATCHED_GRAPH,
    BATCHED_HYBRID_INPUTS,
    BATCHED_INPUTS,
    DTYPES,
    MTP_INPUTS,
    TREE_INPUTS,
    TREE_SHAPE_INPUTS,
    draft_rows_exported,
    draft_takes_anchor,
    gdn_io_names,
    layer_types,
    target_takes_ids,
    tree_inputs_exported,
)


def _ort_version(ort) -> tuple[int, int]:
    try:
        return tuple(int(x) for x in ort.__version__.split(".")[:2])
    except ValueError:
        return (0, 0)


def empty_rows_supported(ort) -> bool:
    """Whether this onnxruntime runs the target's greedy form (no uniforms: reductions over 0 rows).

    onnxruntime 1.23.2 mis-broadcasts the empty sampling branch (a Where over [0] inputs fails with
    "Can broadcast 0 by 0 or 1"); 1.32 runs it. Older versions get 1 + N uniforms, the form every
    version runs, at the cost of the (then unused) sampling branch.
    """
    return _ort_version(ort) >= (1, 32)


def _optimization_level(ort):
    """Graph optimisation level for these graphs: ENABLE_ALL on every supported onnxruntime (the
    optimizers that crash some versions are turned off by name in `disabled_optimizers`)."""
    return ort.GraphOptimizationLevel.ORT_ENABLE_ALL


_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)"}


# Largest INT4 block whose level-4 MatMulNBits gives every row of a call the same floats as a padded
# plain step computes (measured on an AVX-512 VNNI EPYC, onnxruntime 1.32, SmolLM2, calls of 1-16 rows:
# block 32 exact in every row position; block 64 rounds the last row of a 3-, 5- or 9-row call as a
# one-row call does, up to 1.1 in K/V, and 4-5 of 15 held-out prompts then left plain decoding, which
# padding one-row calls cannot fix: `scripts/int4_split_check.py` and /tmp-style row-position probes).
INT8_EXACT_MAX_BLOCK = 32


def default_int4_accuracy_level(manifest: dict) -> int:
    """MatMulNBits accuracy level for an INT4 artifact when the caller names none: 4 (int8 activations)
    only where every row computes the same floats in any call (a row-exact fp32 target with INT4 blocks
    of at most INT8_EXACT_MAX_BLOCK), else 1 (fp32 compute, exactly the dequantized model)."""
    block = int((manifest.get("quantization") or {}).get("block", 0))
    exact = manifest["target"].get("row_exact") and manifest.get("dtype") == "fp32"
    return 4 if exact and 0 < block <= INT8_EXACT_MAX_BLOCK else 1


def disabled_optimizers(manifest: dict, ort=None) -> list[str]:
    """onnxruntime graph optimizers to turn off for this artifact on this onnxruntime.

    - onnxruntime < 1.32 (1.23.2 is the newest wheel for JetPack 6's Python 3.10): MatmulTransposeFusion
      folds the past-K transpose into a FusedMatMul that dies with a floating-point exception (SIGFPE)
      on an empty past, i.e. the first prefill. Found by disabling each extended-level optimizer in
      turn on 1.23.2 (only this one matters); 1.32 runs it. Without it the optimized graph transposes
      each layer's past K on every call (an O(past) copy), which 1.32 avoids.
    - INT4 artifacts: MatMulAddFusion (basic level) turns `MatMul(x, DequantizeLinear(W)) + residual` into
      a Gemm before the extended level's DQMatMulToMatMulNBits sees it, so o_proj and down_proj (whose
      outputs feed the residual adds) would stay DequantizeLinear + Gemm, re-expanding their weights
      every call.
    """
    if ort is None:
        import onnxruntime as ort
    names = [] if _ort_version(ort) >= (1, 32) else ["MatmulTransposeFusion"]
    return names + (["MatMulAddFusion"] if manifest.get("quantization") else [])


def host_binders(ort, binding) -> tuple:
    """(bind_input, bind_output) for `binding`, each taking (name, numpy dtype, shape, host address).

    They call onnxruntime's C++ binding with one CPU device object made here: the public
    `IOBinding.bind_input` makes a device object per call (1.5 against 0.7 us a bind, and a step binds
    each layer's past and new K/V). Where a version lacks the private `_iobinding`, the public calls.
    """
    native = getattr(binding, "_iobinding", None)
    device_class = getattr(getattr(ort.capi, "onnxruntime_inference_collection", None), "OrtDevice", None)
    if native is None or device_class is None:
        return (lambda name, dtype, shape, ptr: binding.bind_input(name, "cpu", 0, dtype, shape, ptr),
                lambda name, dtype, shape, ptr: binding.bind_output(name, "cpu", 0, dtype, shape, ptr))
    device = device_class.make("cpu", 0)._get_c_device()
    return (lambda name, dtype, shape, ptr: native.bind_input(name, device, dtype, shape, ptr),
            lambda name, dtype, shape, ptr: native.bind_output(name, device, dtype, shape, ptr))


def check_graph_io(graph: str, inputs: list[tuple[str, str]], manifest: dict) -> None:
    """Check a loaded graph's inputs against what the manifest promises (names, layer count, dtype).

    Raises:
        DFlashError: the graph and the manifest disagree (a damaged or hand-edited artifact).
    """

    if graph in (BATCHED_GRAPH, BATCHED_DRAFT_GRAPH):
        return _check_batched_io(graph, inputs, manifest)
    if graph == "mtp":
        if tuple(name for name, _ in inputs) != MTP_INPUTS:
            raise DFlashError(f"mtp graph inputs {[n for n, _ in inputs]} are not {list(MTP_INPUTS)}; the artifact is "
                              "damaged, rebuild it")
        kv_type = dict(inputs)["past_key"]
        if kv_type != _ORT_TYPES[DTYPES[manifest["dtype"]]]:
            raise DFlashError(f"mtp graph stores K/V as {kv_type} but the manifest says {manifest['dtype']}; rebuild the artifact")
        return None
    n = int(manifest[graph]["num_layers"])
    proposes = target_takes_ids(manifest)
    proposals = "proposal_ids" if proposes else "draft_hidden"
    lead = ["input_ids", proposals, "temperature", "uniform"] if graph == "target" else ["context_hidden", "block_embeddings"]
    if graph == "target" and tree_inputs_exported(manifest):
        lead += list(TREE_SHAPE_INPUTS if proposes else TREE_INPUTS)
    if graph == "draft" and draft_rows_exported(manifest):
        lead.append("proposal_rows")
    if graph == "draft" and draft_takes_anchor(manifest):
        lead.append("anchor_ids")
    types = layer_types(manifest[graph])
    expected = list(lead)
    for i, kind in enumerate(types):
        expected += gdn_io_names(i)[0] if kind == "linear_attention" else [f"past_key_{i}", f"past_value_{i}"]
    names = [name for name, _ in inputs]
    if names != expected:
        raise DFlashError(
            f"{graph} graph inputs {names[:6]}... do not match the manifest ({n} layers: {expected[:6]}...); "
            "the artifact is damaged, rebuild it"
        )
    kv_type = dict(inputs)[f"past_key_{next(i for i, kind in enumerate(types) if kind != 'linear_attention')}"]
    if kv_type != _ORT_TYPES[DTYPES[manifest["dtype"]]]:
        raise DFlashError(f"{graph} graph stores K/V as {kv_type} but the manifest says {manifest['dtype']}; rebuild the artifact")


def _check_batched_io(graph: str, inputs: list[tuple[str, str]], manifest: dict) -> None:
    """`check_graph_io` for the batched target and draft graphs (`runtime.batching`)."""
    types = layer_types(manifest["target"]) if graph == BATCHED_GRAPH else ["full_attention"] * int(manifest["draft"]["num_layers"])
    hybrid = "linear_attention" in types
    lead = (BATCHED_INPUTS + (BATCHED_HYBRID_INPUTS if hybrid else ())) if graph == BATCHED_GRAPH else BATCHED_DRAFT_INPUTS
    expected = list(lead)
    for i, kind in enumerate(types):
        expected += gdn_io_names(i)[0] if kind == "linear_attention" else [f"past_key_{i}", f"past_value_{i}"]
    if [name for name, _ in inputs] != expected:
        raise DFlashError(f"{graph} graph inputs do not match the manifest ({len(types)} layers); the artifact is "
                          "damaged, rebuild it with --batched")
    first_kv = next(i for i, kind in enumerate(types) if kind != "linear_attention")
    if dict(inputs)[f"past_key_{first_kv}"] != _ORT_TYPES[DTYPES[manifest["dtype"]]]:
        raise DFlashError(f"{graph} graph stores K/V in another dtype than the manifest's {manifest['dtype']}; rebuild")


class HostBuffer(Buffer):
    """A Buffer backed by a 256-byte aligned numpy array (`.array`, 1-D); with `stack` (a contiguous
    `[count, capacity]` array, :meth:`OrtBackend.alloc_stack`), row `index` of that array."""

    def __init__(self, dtype, capacity: int, row_shape=(), stack: np.ndarray | None = None, index: int = 0):
        super().__init__(dtype, capacity, row_shape)
        if stack is None:
            raw = np.zeros(self.capacity * self.dtype.itemsize + ADDRESS_ALIGNMENT, dtype=np.uint8)
            start = (-raw.ctypes.data) % ADDRESS_ALIGNMENT
            self._raw = raw
            self.array = raw[start : start + self.capacity * self.dtype.itemsize].view(self.dtype)
        else:
            self.array = stack[index]  # (a view: it keeps the allocation alive)
        self.stack, self.index = stack, index
        self.ptr = self.array.ctypes.data

    def host(self, view: View) -> np.ndarray:
        """numpy view (no copy) of a View on this buffer."""
        return self.array[view.offset : view.offset + view.size].reshape(view.shape)


class OrtBackend(Backend):
    """Runs the target and draft graphs with onnxruntime.

    Args:
        artifact_dir: the artifact directory.
        manifest: its validated manifest.
        providers: onnxruntime execution providers (default: CPU).
        provider_options: one dict of options per provider (default: none).
        threads: intra-op threads (default: all cores).
        low_memory: hold the weights about once (for `check` of large graphs): no memory arena, nodes
            run in priority order, and fp16 graphs on the CPU stay at the basic optimisation level,
            where the fp32 casts onnxruntime inserts for its fp16-less CPU kernels run per call
            instead of being folded into an fp32 copy of every weight (measured on a 1.7B-shaped
            fp16 target: peak 4.6 GiB instead of 7.3 GiB; calls are 2-3x slower).
        graphs: the graphs to load (`check` loads one at a time).
        int4_accuracy_level: the compute type of the MatMulNBits kernel onnxruntime fuses INT4 weights
            into. 1 = fp32: exactly the dequantized model the artifact defines. 4 = activations
            rounded to int8 per weight block (W4A8, onnxruntime's and onnxruntime-genai's default;
            1.3-2x faster decoding on CPUs). Level 4 turns a one-ulp difference into a whole int8
            step, so it is lossless only when every row computes the same floats in any call: the
            target's attention is split-invariant (manifest `target.row_exact`, artifacts built
            since it exists) and one-row calls that round differently are padded to two rows
            (`Session.pad_single_rows`). None (default): 4 for such fp32 artifacts, 1 for others:
            hybrid targets (their chunked recurrence rounds by call size), older artifacts, and fp16
            graphs, whose fp16 operators on onnxruntime's CPU round a row by the call's shape
            (SmolLM2 fp16 int4: 0.02 in logits at level 1, 0.56 at level 4, padded split;
            `scripts/int4_split_check.py`).
        spin_threads: let worker threads spin while a run dispatches work, stopping at the end of
            each run (`session.force_spinning_stop`); False: they sleep between operators. See the
            comment in the constructor.

    Raises:
        DFlashError: onnxruntime is missing or cannot load a graph.
    """

    name = "ort"

    def __init__(self, artifact_dir: Path, manifest: dict, providers: list[str] | None = None, threads: int | None = None,
                 low_memory: bool = False, graphs: tuple[str, ...] = ("target", "draft"),
                 int4_accuracy_level: int | None = None, spin_threads: bool = True,
                 provider_options: list[dict] | None = None):
        try:
            import onnxruntime as ort
        except ImportError:
            raise DFlashError("onnxruntime is not installed: pip install onnxruntime") from None
        self._ort = ort
        self.greedy_without_uniforms = empty_rows_supported(ort)
        self.threads = int(threads or os.cpu_count() or 1)
        self.spin_threads = bool(spin_threads)
        if int4_accuracy_level is None:
            int4_accuracy_level = default_int4_accuracy_level(manifest)
        if int4_accuracy_level not in (1, 4):
            raise DFlashError(f"int4_accuracy_level must be 1 (fp32 compute) or 4 (int8 activations), not {int4_accuracy_level!r}")
        self.int4_accuracy_level = int4_accuracy_level if manifest.get("quantization") else None
        self.providers = list(providers or ["CPUExecutionProvider"])
        # int8 activations amplify a one-ulp difference between a row's calls: Session checks one-row calls
        self.int8_activations = self.int4_accuracy_level == 4 and self.providers == ["CPUExecutionProvider"]
        # one IOBinding per graph, and what each name is bound to: a call rebinds only what moved
        self._bindings: dict[str, tuple] = {}
        # onnxruntime's CPU memory arena keeps every chunk it ever took, so a long prompt's activations
        # stayed in the process for good: a server's RSS went from 0.83 GiB loaded to 2.52 GiB after
        # four 2,000-token prompts (SmolLM2 fp32, max_seq_len 2048), never returned. Shrinking the arena
        # at the end of each run returns the chunks the run freed: 0.96 GiB after the same prompts (the
        # peak, during a prefill, 1.76 GiB), prefill time unchanged, and plain decoding within noise
        # (2 shared cores, interleaved processes and alternating generations in one process, medians:
        # 8.11 vs 8.07 tok/s). Without the arena (`enable_cpu_mem_arena = False`) RSS ends near 1.0 GiB
        # but every tensor is a malloc. low_memory has no arena: nothing to shrink, and onnxruntime
        # refuses the option there. (tests/test_serve_memory.py checks both the option and the RSS.)
        self._run_options = None
        if not low_memory:
            self._run_options = ort.RunOptions()
            self._run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            # onnxruntime 1.32's run_with_iobinding looks this key up on every run, and a missing key costs a
            # C++ exception (24 us a run); "0" is what it assumes when the key is missing
            self._run_options.add_run_config_entry("gpu_graph_id", "0")
        self.sessions = {}
        for graph in graphs:
            path = Path(artifact_dir) / manifest[graph]["graph"]
            # Worker threads spin while a run dispatches its operators (a sleeping worker costs a
            # wake-up per parallel operator: SmolLM2 plain decoding, 2 cores, interleaved: int4 78.5 ->
            # 105.9 tok/s, fp32 38.5 -> 45.6) and stop spinning when the run returns
            # (force_spinning_stop): the two graphs alternate every step, and spinning threads of the
            # idle session would steal the cores from the other one (measured before that option was
            # used: a draft + 1-proposal verify step 1.35-1.42x a plain step with the target spinning
            # after its runs, 1.24-1.26x with neither spinning; `python scripts/step_overhead.py ARTIFACT`).
            # onnxruntime's process-wide pool would also fix it, but it breaks every other
            # InferenceSession the host program creates.
            opts = ort.SessionOptions()
            opts.graph_optimization_level = _optimization_level(ort)
            opts.log_severity_level = 3
            opts.intra_op_num_threads = self.threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_threads else "0")
            opts.add_session_config_entry("session.force_spinning_stop", "1")
            if int4_accuracy_level is not None:
                opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(int4_accuracy_level))
            if low_memory:
                opts.enable_cpu_mem_arena = False
                opts.enable_mem_pattern = False
                opts.execution_order = ort.ExecutionOrder.PRIORITY_BASED
                # (INT4 graphs keep their level: fused into MatMulNBits they hold only the INT4 weights,
                # unfused every DequantizeLinear runs first and all weights exist dequantized at once)
                if (manifest.get("dtype") == "fp16" and self.providers == ["CPUExecutionProvider"]
                        and not manifest.get("quantization")):
                    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            try:
                self.sessions[graph] = ort.InferenceSession(str(path), opts, providers=self.providers,
                                                            provider_options=provider_options,
                                                            disabled_optimizers=disabled_optimizers(manifest, ort))
            except Exception as exc:  # onnxruntime raises its own untyped Fail errors
                raise DFlashError(f"onnxruntime cannot load {path}: {exc}") from None
            check_graph_io(graph, [(i.name, i.type) for i in self.sessions[graph].get_inputs()], manifest)

    def alloc(self, dtype, rows: int, row_shape=()) -> HostBuffer:
        return HostBuffer(dtype, rows * int(np.prod(row_shape, dtype=np.int64) if row_shape else 1), row_shape)

    def alloc_stack(self, count: int, dtype, rows: int, row_shape=()) -> list[HostBuffer]:
        dtype = np.dtype(dtype)
        capacity = rows * int(np.prod(row_shape, dtype=np.int64) if row_shape else 1)
        if capacity * dtype.itemsize % ADDRESS_ALIGNMENT:  # (back to back, each would not start aligned)
            return super().alloc_stack(count, dtype, rows, row_shape)
        stack = HostBuffer(dtype, count * capacity).array.reshape(count, capacity)
        return [HostBuffer(dtype, capacity, row_shape, stack, i) for i in range(count)]

    def write(self, view: View, values: np.ndarray) -> None:
        view.buffer.host(view)[...] = values

    def read(self, view: View) -> np.ndarray:
        return view.buffer.host(view).copy()

    def copy(self, dst: View, src: View) -> None:
        dst.buffer.host(dst)[...] = src.buffer.host(src).reshape(dst.shape)

    def scatter_heads(self, dst: Buffer, rows: np.ndarray | slice, src: View, src_rows: np.ndarray | slice) -> None:
        heads, d = src.shape[1], src.shape[2]
        dst.array.reshape(heads, -1, d)[:, rows, :] = src.buffer.host(src)[src_rows].transpose(1, 0, 2)

    def scatter_heads_stack(self, dsts: list[Buffer], rows: np.ndarray | slice, srcs: list[View],
                            src_rows: np.ndarray | slice) -> None:
        first, src0 = dsts[0], srcs[0]
        stacked = (first.stack is not None and src0.buffer.stack is not None
                   and all(d.stack is first.stack and d.index == i for i, d in enumerate(dsts))
                   and len(dsts) == first.stack.shape[0] and len(srcs) == src0.buffer.stack.shape[0]
                   and all(v.buffer.stack is src0.buffer.stack and v.buffer.index == i and v.offset == src0.offset
                           and v.shape == src0.shape for i, v in enumerate(srcs)))
        if not stacked:
            return super().scatter_heads_stack(dsts, rows, srcs, src_rows)
        n, (count, heads, d) = len(dsts), src0.shape
        new = src0.buffer.stack[:, src0.offset : src0.offset + src0.size].reshape(n, count, heads, d)
        first.stack.reshape(n, heads, -1, d)[:, :, rows, :] = new[:, src_rows].transpose(0, 2, 1, 3)

    def gather_heads(self, dst: View, src: Buffer, rows: np.ndarray | slice) -> None:
        heads, d = dst.shape[1], dst.shape[2]
        dst.buffer.host(dst)[...] = src.array.reshape(heads, -1, d)[:, rows, :].transpose(1, 0, 2)

    def run(self, graph: str, inputs: dict[str, View], outputs: dict[str, View]) -> None:
        binding, bound, binders = self._binding(graph, inputs, outputs)
        for names, bind, views in ((bound[0], binders[0], inputs), (bound[1], binders[1], outputs)):
            for name, (buf, offset, shape) in views.items():
                where = (buf.ptr + offset * buf.itemsize, shape)
                if names.get(name) != where:  # the past K/V views grow every step; ids, taps... often stay
                    bind(name, buf.dtype, list(shape), where[0])
                    names[name] = where
        self.sessions[graph].run_with_iobinding(binding, self._run_options)

    def _binding(self, graph: str, inputs: dict, outputs: dict) -> tuple:
        """The graph's IOBinding, what each name is bound to, and its (input, output) binders; a new
        IOBinding when the set of bound names changes (an unbound output)."""
        entry = self._bindings.get(graph)
        if entry is None or entry[1][0].keys() != inputs.keys() or entry[1][1].keys() != outputs.keys():
            binding = self.sessions[graph].io_binding()
            entry = (binding, ({}, {}), host_binders(self._ort, binding))
            self._bindings[graph] = entry
        return entry

    def describe(self) -> dict:
        return {"name": self.name, "onnxruntime": self._ort.__version__, "providers": self.providers,
                "threads": self.threads, "spin_threads": self.spin_threads, "int4_accuracy_level": self.int4_accuracy_level}

    def close(self) -> None:
        self._bindings.clear()
        self.sessions.clear()
