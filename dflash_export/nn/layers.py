"""Small export-friendly PyTorch modules for the target (Qwen3 / Llama) and the layers the DFlash draft
(`dflash_export.nn.draft`) shares with it.

They load Hugging Face weights under the checkpoint's own names, take batch-1 tensors with the
sequence axis outermost, and make every cache explicit: past K/V go in as `[P, Hkv, D]` tensors and
only the NEW rows come out, so a runtime can keep one static buffer per layer and roll back by
length. Positions follow from the past length (the shape of the first past tensor), and RoPE
is computed in fp32 from those positions at run time: no table is frozen at export length.

Tested against the Hugging Face models (target) and a plain reading of the DFlash math (draft).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dflash_export.checkpoint.target import AttentionSpec, TargetSpec
from dflash_export.checkpoint.weights import placeholder
from dflash_export.nn.tables import (  # noqa: F401
    apply_rope,
    causal_bias,
    key_ones_for,
    rope_cos_sin,
    rope_inv_freq,
    rope_matrix,
    tree_bias,
)
from runtime.errors import DFlashError
from runtime.graphs.tree import (
    TREE_RANKS,  # a verify tree's nodes are among the draft's top TREE_RANKS candidates
)


def _ranked_rows(scores: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """int64 `[N]`: the index of row i's `rank[i]`-th highest score (`scores [N, V]`, rank int64 `[N]` in
    [0, TREE_RANKS)). One TopK with a constant K (TensorRT takes K as a build-time constant); ties go to
    the lower index (ONNX TopK), as argmax's do, so rank 0 is the argmax. TopK runs on one extra zero
    row: onnxruntime 1.23.2's TopK dies (SIGFPE) on an empty input, which every prefill and plain step
    gives it."""
    padded = torch.cat([scores, torch.zeros_like(scores[:1])], dim=0)
    top = torch.topk(padded, min(TREE_RANKS, scores.shape[-1]), dim=-1).indices[: scores.shape[0]]
    return torch.gather(top, 1, rank[:, None]).reshape(-1)


def proposal_table(scores: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's candidates per block row from its head scores `scores [R, V']` (fp32) over the
    proposal vocabulary `vocab` (int64 `[V']` target ids; None: all V ids).

    Returns:
        (ids int64 `[R, K]`, probs fp32 `[R, K]`): each row's K = min(TREE_RANKS, V') most probable
        candidates in rank order (ONNX TopK: ties to the lower index, so rank 0 is the argmax) and
        their softmax probabilities over the proposal vocabulary: the draft's confidence, which the
        runtime uses to choose how many proposals to verify (`runtime.speculation.policy`).
    """
    probs = torch.softmax(scores.to(torch.float32), dim=-1)
    top = torch.topk(probs, min(TREE_RANKS, scores.shape[-1]), dim=-1)
    ids = top.indices if vocab is None else torch.index_select(vocab, 0, top.indices.reshape(-1)).reshape(top.indices.shape)
    return ids, top.values


def _argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """int64 `[N]` argmax of each row of `scores [N, V]`, also for N = 0: onnxruntime 1.23.2's ArgMax
    returns an empty `[0, V]` (its input's shape) for an empty input, so the reduction keeps its axis
    and a Reshape to `[-1]` gives `[0]` on every version."""
    return torch.argmax(scores, dim=-1, keepdim=True).reshape(-1)


class RMSNorm(nn.Module):
    """RMSNorm as in Hugging Face Llama/Qwen3 (`[..., width]` in, same shape and dtype out).

    Statistics and the weight multiply run in fp32 whatever the input dtype (identical to HF in
    fp32; in fp16 it avoids rounding the normalised value before scaling).
    """

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        # x / sqrt(...) rather than x * rsqrt(...): onnxruntime fuses this form (Pow, ReduceMean, Add,
        # Sqrt, Div, Mul) into one SimplifiedLayerNormalization; the rsqrt form stays 7 nodes
        xf = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.to(torch.float32) * xf).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, inner: int, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=bias)
        self.up_proj = nn.Linear(d, inner, bias=bias)
        self.down_proj = nn.Linear(inner, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA attention over an explicit past `[P, Hkv, D]` plus new rows, without copying the past.

    Scores against the past and against the new rows are computed separately and joined before
    one softmax, so the cache is read once and never concatenated (no per-step cache copy).
    """

    def __init__(self, arch: AttentionSpec, qk_norm: bool):
        super().__init__()
        d, hd = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.q_proj = nn.Linear(d, arch.num_heads * hd, bias=arch.attention_bias)
        self.k_proj = nn.Linear(d, arch.num_kv_heads * hd, bias=arch.attention_bias)
        self.v_proj = nn.Linear(d, arch.num_kv_heads * hd, bias=arch.attention_bias)
        self.o_proj = nn.Linear(arch.num_heads * hd, d, bias=arch.attention_bias)
        self.scale = 1.0 / math.sqrt(hd)  # of the attention scores
        self.q_norm = RMSNorm(hd, arch.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(hd, arch.rms_norm_eps) if qk_norm else None

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x [S, d]` -> rotated queries `[S, H, D]`. `attend` takes queries rotated by tables multiplied
        by `self.scale`, so the score scale costs one Mul per graph, not one per layer."""
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [S, d]` -> (rotated keys, values), each `[S, Hkv, D]` (the rows a cache stores)."""
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def attend(
        self,
        q: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        new_k: torch.Tensor,
        new_v: torch.Tensor,
        new_bias: torch.Tensor | None,
        past_bias: torch.Tensor | None = None,
        key_ones: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `q [T, H, D]` over past `[P, Hkv, D]` and new `[S, Hkv, D]` rows.

        `q` already carries the 1/sqrt(D) score scale (see `query`). `new_bias` (fp32 `[g * T, S]`,
        `causal_bias`) masks the new rows; `past_bias` (fp32 `[g * T, P]`, a draft's sliding window)
        the past, which is otherwise always visible. Returns `[T, H * D]` before o_proj.

        `key_ones` (fp32 `[P + S, 16]` ones, `key_ones_for`; the target's layers) selects the
        split-invariant form: each query row's output is bit-identical however the
        rows are split into past and new (row k of a verify call and the one row of a later plain step
        see the same floats), so speculative output equals plain output exactly, also under kernels that
        turn a one-ulp difference into an int8 rounding step (onnxruntime's MatMulNBits at accuracy
        level 4). Every sum over keys is one MatMul over the concatenated values, whose per-element
        accumulation runs over the keys in order (masked keys add exact zeros); the split form's softmax
        and two-part value sum round differently per split. Cost: one copy of the past V per layer
        and call (`python scripts/int4_split_check.py` shows the difference is 0).
        """
        t = q.shape[0]
        g = self.num_heads // self.num_kv_heads
        # Head h uses kv head h // g (HF repeat_kv): group the query heads per kv head.
        qg = q.view(t, self.num_kv_heads, g, self.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(self.num_kv_heads, g * t, self.head_dim)
        s_past = torch.matmul(qg, past_k.permute(1, 2, 0)).to(torch.float32)
        s_new = torch.matmul(qg, new_k.permute(1, 2, 0)).to(torch.float32)
        if new_bias is not None:
            s_new = s_new + new_bias
        if past_bias is not None:
            s_past = s_past + past_bias
        scores = torch.cat([s_past, s_new], dim=-1)
        if key_ones is not None:
            out = _split_invariant_values(scores, torch.cat([past_v, new_v], dim=0), key_ones, q.dtype)
            out = out.view(self.num_kv_heads, g, t, self.head_dim).permute(2, 0, 1, 3)
            return out.reshape(t, self.num_heads * self.head_dim)
        p = torch.softmax(scores, dim=-1).to(q.dtype)
        n_past = past_k.shape[0]
        out = torch.matmul(p[..., :n_past], past_v.permute(1, 0, 2)) + torch.matmul(
            p[..., n_past:], new_v.permute(1, 0, 2)
        )
        out = out.view(self.num_kv_heads, g, t, self.head_dim).permute(2, 0, 1, 3)
        return out.reshape(t, self.num_heads * self.head_dim)


def _split_invariant_values(scores: torch.Tensor, values: torch.Tensor, key_ones: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """softmax(scores) @ values with no reduction whose rounding depends on the key count: the max is
    exact in any order, and both the weighted value sum and the normaliser are MatMuls over the keys
    (sequential per element). `scores` fp32 `[Hkv, R, L]`, `values` `[L, Hkv, D]`, `key_ones` fp32
    `[L, 16]` -> `[Hkv, R, D]`."""
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    numerator = torch.matmul(e.to(dtype), values.permute(1, 0, 2)).to(torch.float32)
    denominator = torch.matmul(e, key_ones)[..., :1]
    return (numerator / denominator).to(dtype)


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer (Llama / Qwen3 naming)."""

    def __init__(self, arch: AttentionSpec, qk_norm: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, qk_norm)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size, arch.mlp_bias)

    def forward(self, h, rope_q, rope_k, past_k, past_v, causal, key_ones):
        """One causal target layer: `h [S, d]` -> (`h [S, d]`, new keys, new values `[S, Hkv, D]`).

        `rope_q` / `rope_k` are the (cos, sin) tables of the queries (times the score scale, see
        `Attention.query`) and the keys; `causal` is the `causal_bias` of the S new rows, `key_ones`
        the `key_ones_for` the P + S keys. The whole
        layer runs inside this module call, so every exported node of it carries the layer's name
        scope (`model.layers.i`): `export.replication` cuts one layer's nodes out by that scope.
        """
        x = self.input_layernorm(h)
        q = self.self_attn.query(x, *rope_q)
        k, v = self.self_attn.key_value(x, *rope_k)
        attn = self.self_attn.attend(q, past_k, past_v, k, v, causal, key_ones=key_ones)
        h = h + self.self_attn.o_proj(attn)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, k, v


class _TargetBody(nn.Module):
    def __init__(self, spec: TargetSpec):
        super().__init__()
        a = spec.arch
        self.embed_tokens = nn.Embedding(spec.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(a, spec.family == "qwen3") for _ in range(a.num_layers)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class TargetForExport(nn.Module):
    """The target with tap features, new K/V rows and the draft's LM head exposed.

    Inputs (batch 1, sequence axis outermost):
        input_ids: int64 `[T]`, T >= 1: committed tokens to process (the prompt at prefill, the last
            committed token at a verify or plain decoding step).
        draft_hidden: `[N, d]`, N >= 0: the draft's final hidden states for the block positions
            1..N. They go through the TARGET lm_head (DFlash has no head of its own) and their
            argmax is appended to `input_ids`, so one call proposes and verifies.
            With `draft_proposes` the input is instead `proposal_ids` int64 `[N]`: the proposals
            themselves, which the draft graph ranked with the proposal head (`proposal_table`), and
            there is no `tree_rank` input and no `proposal_ids` output.
        temperature: fp32 `[1]`; 0 means greedy (argmax), > 0 samples the posterior at T.
        uniform: fp32 `[U]` in [0, 1), U = 1 + N to sample (one uniform per logits row, inverse CDF)
            or U = 0 for greedy decoding: then no softmax/cumsum over the vocabulary runs at all
            (a measurable share of a verify; figures:
            docs/performance.md#lm-head-form-packed-projections-sampling-branch-2026-11-30-to-2026-12-01).
            With temperature 0 the uniforms are ignored.
        tree_depth: int64 `[N]`: proposal i's block position minus 1 (`draft_hidden` row it reads;
            position P + T + tree_depth[i]). A chain's is 0..N-1.
        tree_rank: int64 `[N]` in [0, TREE_RANKS): proposal i is the draft's rank-th candidate there
            (0: its argmax).
        tree_bias: fp32 `[N, N]`: which proposals proposal i attends to (0: its ancestors and itself,
            the fp32 minimum elsewhere; `nn.tables.tree_bias`). A chain's is causal. With these
            three inputs one call verifies a tree of proposals (several candidates for one position),
            as SpecInfer (Miao et al., ASPLOS 2024) and Medusa (Cai et al., ICML 2024) do.
        past_key_i / past_value_i: `[P, Hkv, D]` for each layer i; positions start at P.

    Outputs:
        next_ids: int64 `[1 + N]`: the target's token after each of the last 1 + N positions
            (posterior; sampled at `temperature`).
        proposal_ids: int64 `[N]`: the rank-`tree_rank[i]` candidate of lm_head(draft_hidden[tree_depth[i]])
            (the argmax at rank 0), taken over `draft_vocab` when the
            draft has one (a reduced proposal vocabulary as in FR-Spec, Zhao et al., 2025: fewer head
            rows per proposal; verification still uses the full head, so output is unchanged).
        next_embeddings: `[1 + N, d]`: embed_tokens(next_ids), the draft's next block anchor.
        logits: fp32 `[1 + N, V]` for the last 1 + N positions (prefill needs only its last row).
        taps: `[T + N, k * d]`: outputs of the tap layers (HF `hidden_states[L + 1]`; the last
            layer's is taken after the final norm, as in Hugging Face).
        key_i / value_i: `[T + N, Hkv, D]`: the new K/V rows, to be written at row P of the cache.
    """

    draft_proposes = False  # (a family module borrowing these methods without this __init__ takes draft_hidden)

    def __init__(
        self, spec: TargetSpec, tap_layers: tuple[int, ...], dtype: torch.dtype = torch.float32, draft_vocab=None,
        draft_proposes: bool = False,
    ):
        super().__init__()
        self.spec = spec
        # the draft graph holds the proposal head and passes proposal ids in (an export module then gets
        # no draft_vocab: it holds no proposal rows; a reference keeps it to score the draft's rows)
        self.draft_proposes = bool(draft_proposes)
        self.tap_layers = tuple(tap_layers)
        # int64 [V']: the proposal vocabulary (None: all V ids)
        vocab = None if draft_vocab is None else torch.tensor(list(draft_vocab), dtype=torch.int64)
        self.register_buffer("draft_vocab", vocab, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)  # set by freeze_draft_head()
        self.model = _TargetBody(spec)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.arch.hidden_size, spec.vocab_size, bias=False)
        inv, scale = rope_inv_freq(spec.arch, spec.family)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self.compute_dtype = dtype

    def head_weight(self) -> torch.Tensor:
        """The `[V, d]` LM head matrix (embed_tokens' when tied: stored once)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits_of(self, h: torch.Tensor) -> torch.Tensor:
        """`h [S, d]` -> fp32 logits `[S, V]`, as `Gemm(h, W, transB=1)`: the tied table is read in place
        (no transposed copy), and onnxruntime pre-packs it as a GEMM's B operand (the (W @ h^T)^T form,
        with W as operand A, ran far below the memory bandwidth; figures:
        docs/performance.md#lm-head-form-packed-projections-sampling-branch-2026-11-30-to-2026-12-01)."""
        return nn.functional.linear(h, self.head_weight()).to(torch.float32)

    def propose(self, draft_hidden: torch.Tensor, depth: torch.Tensor | None = None,
                rank: torch.Tensor | None = None) -> torch.Tensor:
        """int64 `[N]` proposal ids: argmax of the head over the proposal vocabulary, or with a verify
        tree's `depth` / `rank` (see the class docstring), row depth[i]'s rank[i]-th candidate."""
        h = draft_hidden.to(self.compute_dtype)
        if depth is not None:
            h = torch.index_select(h, 0, depth)
        scores = self.proposal_scores(h)
        picked = _argmax_rows(scores) if rank is None else _ranked_rows(scores, rank)
        return picked if self.draft_vocab is None else torch.index_select(self.draft_vocab, 0, picked)

    def proposal_scores(self, h: torch.Tensor) -> torch.Tensor:
        """`h [N, d]` -> the head's scores `[N, V']` over the proposal vocabulary (all V ids without one)."""
        if self.draft_vocab is None:
            return self.logits_of(h)
        rows = self.draft_head if self.draft_head is not None else torch.index_select(self.head_weight(), 0, self.draft_vocab)
        return nn.functional.linear(h, rows)

    def head_weight_name(self) -> str:
        """The parameter name of the LM head matrix (the embedding's when tied)."""
        return "model.embed_tokens.weight" if self.lm_head is None else "lm_head.weight"

    def freeze_draft_head(self, head_reader=None):
        """Store the draft vocabulary's head rows `[V', d]` as one tensor (after loading weights, before
        export). The exported graph then holds the ids and those rows exactly once; left as a Gather of
        the full head, the exporter folds small cases and copies the id list in large ones.

        Args:
            head_reader: when the head is a streamed placeholder (`weights.bind_weights`), its reader:
                the rows become a placeholder too and the returned reader selects them when written.

        Returns:
            the reader of `draft_head` when streamed, else None.
        """
        if self.draft_vocab is None:
            return None
        if head_reader is None:
            with torch.no_grad():
                self.draft_head = torch.index_select(self.head_weight(), 0, self.draft_vocab).clone()
            return None

        self.draft_head = placeholder((len(self.draft_vocab), self.head_weight().shape[1]), self.head_weight().dtype)
        vocab = self.draft_vocab
        return lambda: torch.index_select(head_reader(), 0, vocab)

    def forward(self, input_ids, proposals, temperature, uniform, *rest):
        """`rest`: (tree_depth, tree_rank, tree_bias, *past), without tree_rank when `draft_proposes`
        (then `proposals` are the proposal ids, else the draft's hidden rows)."""
        if self.draft_proposes:
            (tree_depth, tree_bias), past, proposal_ids = rest[:2], rest[2:], proposals
        else:
            (tree_depth, tree_rank, tree_bias), past = rest[:3], rest[3:]
            proposal_ids = self.propose(proposals, tree_depth, tree_rank)
        ids = torch.cat([input_ids, proposal_ids], dim=0)
        h, tap_features, new_caches = self.body(ids, past, tree_depth, tree_bias)
        return self._outputs(self.head(h, input_ids.shape[0], proposal_ids, temperature, uniform, tap_features, new_caches))

    def chain_forward(self, input_ids, proposals, temperature, uniform, *past):
        """`forward` without the verify-tree inputs: proposal i is row i's argmax (or the given id),
        the rows are causal (the interface of a family whose layers cannot verify a tree, e.g.
        recurrent ones)."""
        proposal_ids = proposals if self.draft_proposes else self.propose(proposals)
        ids = torch.cat([input_ids, proposal_ids], dim=0)
        h, tap_features, new_caches = self.body(ids, past)
        return self._outputs(self.head(h, input_ids.shape[0], proposal_ids, temperature, uniform, tap_features, new_caches))

    def _outputs(self, outs: tuple) -> tuple:
        """`head`'s outputs as the graph returns them: without `proposal_ids` when the draft proposes
        (the runtime passed them in)."""
        return (outs[0], *outs[2:]) if self.draft_proposes else outs

    def body(self, ids: torch.Tensor, past: tuple, tree_depth: torch.Tensor | None = None,
             proposal_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The decoder stack on `ids [S]` after `past`: (final-norm hidden `[S, d]`, tap features
        `[S, k * d]`, the new cache rows in output order). With `tree_depth` / `proposal_bias`, the last
        N rows are a verify tree's proposals (see the class docstring); else all S rows are causal. A
        target family overrides this only."""
        a = self.spec.arch
        h = self.model.embed_tokens(ids)
        s = ids.shape[0]
        p = past[0].shape[0]
        attn0 = self.model.layers[0].self_attn
        group = attn0.num_heads // attn0.num_kv_heads
        if tree_depth is None:
            positions = torch.arange(s, dtype=torch.int64) + p
            causal = causal_bias(s, group)
        else:  # committed rows at P.., proposals at P + T + depth
            t = s - tree_depth.shape[0]
            positions = torch.cat([torch.arange(t, dtype=torch.int64) + p, tree_depth + (p + t)])
            causal = tree_bias(t, proposal_bias, group)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scale)
        rot = rope_matrix(cos, sin)  # (matrix, None): `apply_rope`'s one-MatMul form
        rot_q = rot * attn0.scale  # every layer has the same head_dim
        key_ones = key_ones_for(p, s)
        taps, new_kv = {}, []
        for i, layer in enumerate(self.model.layers):
            h, k, v = layer(h, (rot_q, None), (rot, None), past[2 * i], past[2 * i + 1], causal, key_ones)
            new_kv += [k, v]
            if i in self.tap_layers and i != a.num_layers - 1:
                taps[i] = h
        h = self.model.norm(h)
        return h, self.tap_features(taps, h), new_kv

    def tap_features(self, taps: dict, final: torch.Tensor) -> torch.Tensor:
        """Concatenate the tap layers' outputs; the last layer's is `final` (HF's last hidden_states
        entry is post-final-norm)."""
        if self.num_layers - 1 in self.tap_layers:
            taps[self.num_layers - 1] = final
        return torch.cat([taps[i] for i in self.tap_layers], dim=-1)

    @property
    def num_layers(self) -> int:
        return self.spec.arch.num_layers

    def head(self, h, n_ids: int, proposal_ids, temperature, uniform, tap_features, new_caches) -> tuple:
        """The DFlash outputs from the final hidden states `h [n_ids + N, d]`: logits of the last
        1 + N rows, posterior ids (greedy, or sampled from `uniform`), their embeddings (see the class
        docstring), then `tap_features` and `new_caches` as given."""
        logits = self.logits_of(h[n_ids - 1 :])
        greedy = torch.argmax(logits, dim=-1)
        u = uniform.shape[0]  # rows to sample: 1 + N, or 0 (greedy: the branch below is empty)
        t_safe = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
        cdf = torch.cumsum(torch.softmax(logits[:u] / t_safe, dim=-1), dim=-1)
        # scale u by the CDF's own total: an fp32 cumsum over a large vocabulary can end short of 1
        threshold = uniform[:, None] * cdf[:, -1:]
        # sample = the first token whose CDF exceeds u: counting CDF entries <= u (not < u) skips the
        # zero-probability tokens before it, so u = 0 cannot pick a token without mass
        sampled = torch.clamp((cdf <= threshold).to(torch.int64).sum(dim=-1), max=self.spec.vocab_size - 1)
        rows = logits.shape[0]
        torch._check(u <= rows)
        # pad (not concat) so the exported shape stays exactly 1 + N
        picked = torch.nn.functional.pad(torch.where(temperature > 0, sampled, greedy[:u]), (0, rows - u))
        next_ids = torch.where(torch.arange(rows, dtype=torch.int64) < u, picked, greedy)
        next_embeddings = self.model.embed_tokens(next_ids)
        return (next_ids, proposal_ids, next_embeddings, logits, tap_features, *new_caches)


def load_weights(module: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy a checkpoint state dict into a module (strict: no missing or unexpected weights).

    Raises:
        DFlashError: missing/unexpected names or shape mismatches, named.
    """

    own = module.state_dict()
    if getattr(module, "lm_head", 0) is None:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # tied: HF ties a stored copy too
    missing = [k for k in own if k not in state]
    # rotary buffers are computed, lm_head may be tied
    unexpected = [k for k in state if k not in own and "rotary_emb" not in k and not k.endswith("inv_freq")]
    if missing or unexpected:
        raise DFlashError(
            f"{where}: weights do not match the architecture (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise DFlashError(f"{where}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    module.load_state_dict({k: state[k].to(own[k].dtype) for k in own}, strict=True)


def cast_for_export(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast weights to `dtype`, keeping norms (and the draft's fc) in fp32 for range safety, and the
    RoPE inverse frequencies in fp32 (rounded to fp16 they turn angles wrong by ~0.5 rad at position
    2000)."""
    inv_freq = {name: b for name, b in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, b in inv_freq.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, b)
    for name, sub in module.named_modules():
        if isinstance(sub, RMSNorm) or name == "fc":
            sub.to(torch.float32)
        for leaf in getattr(sub, "keep_fp32", ()):  # e.g. a Gated DeltaNet's decay parameters
            getattr(sub, leaf).data = getattr(sub, leaf).data.to(torch.float32)
    return module
