"""A from-scratch PyTorch reference of DFlash 2 for the tests (tests/test_dflash2.py), written from z-lab/dflash
`model.py` (commit 10129599): `dflash_generate` at T = 0 and with the reference's rejection sampling at T > 0,
`DFlash2DraftModel` (grouped dynamic convolutions around each sublayer, bidirectional or causal sliding
attention over context + block) and `CandidateSelector.select` (top-k of the target's LM head, a walk from
the anchor). float64, no caches: every step recomputes the target over the whole sequence and the draft over
the whole context.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

F64 = torch.float64


def rms(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _convolve(x, dynamic, base, group):
    """The grouped dynamic convolution: x `[B, d]`, dynamic `[B, K, G]`, base `[K, d]`; tap t reads the
    row t back (zero before the block's first row)."""
    b, d = x.shape
    k = base.shape[0]
    parts = x.view(b, d // group, group)
    out = torch.zeros_like(parts)
    for t in range(k):
        shifted = torch.nn.functional.pad(parts, (0, 0, 0, 0, t, 0))[:b]
        out = out + base[t].view(d // group, group) * shifted
        out = out + dynamic[:, t, :, None] * shifted
    return out.view(b, d)


class Reference:
    """The DFlash 2 reference for one draft checkpoint and one HF target."""

    def __init__(self, draft_dir: Path, hf):
        from safetensors.torch import load_file

        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.dcfg = {**self.cfg, **self.cfg["dflash_config"]}  # dflash_config first, else the top level
        self.w = {k: v.to(F64) for k, v in load_file(str(draft_dir / "model.safetensors")).items()}
        self.hf = hf
        self.head = hf.get_output_embeddings().weight.detach().to(F64)
        self.embed = hf.get_input_embeddings().weight.detach().to(F64)

    def target(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits `[T, V]`, tap features `[T, k * d]`) of the whole sequence."""
        with torch.no_grad():
            out = self.hf(torch.tensor([ids]), output_hidden_states=True)
        taps = torch.cat([out.hidden_states[i + 1][0] for i in self.dcfg["target_layer_ids"]], dim=-1)
        return out.logits[0].to(F64), taps.to(F64)

    def draft_hidden(self, context: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """norm(h) of block positions 1..B-1 for context features `[C, k * d]` at positions 0..C-1 and
        block embeddings `[B, d]` at C..C+B-1."""
        cfg, w = self.cfg, self.w
        eps, heads, kv_heads, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        k_taps, groups = self.dcfg["conv_kernel_size"], self.dcfg["conv_group_size"]
        theta = cfg["rope_parameters"]["rope_theta"]
        ctx = rms(context @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        h = block * self.dcfg.get("input_embedding_scale", 1.0)
        c, b = ctx.shape[0], h.shape[0]
        pos = torch.arange(c + b)
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        ang = (pos.float()[:, None] * inv[None, :]).to(F64)
        cos, sin = (torch.cat([t, t], dim=-1)[:, None, :] for t in (ang.cos(), ang.sin()))

        def rope(x, rows):
            return x * cos[rows] + torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1) * sin[rows]

        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            causal = cfg["layer_types"][i] == "sliding_attention" if cfg.get("is_causal") is None else cfg["is_causal"]
            diff = pos[c:, None] - pos[None, :]
            visible = (diff >= 0) if causal else torch.ones_like(diff, dtype=torch.bool)
            if cfg["layer_types"][i] == "sliding_attention":
                visible &= (diff < cfg["sliding_window"]) & (causal | (-diff < cfg["sliding_window"]))
            for sub in ("attention", "mlp"):
                conv = p + ("attention_conv." if sub == "attention" else "mlp_conv.")
                norm = p + ("input_layernorm.weight" if sub == "attention" else "post_attention_layernorm.weight")
                x = rms(h, w[norm], eps)
                dynamic = (x @ w[conv + "kernel_projection.weight"].T).view(b, 2, k_taps, -1)
                x = _convolve(x, dynamic[:, 0], w[conv + "base_kernel"][0], groups)
                if sub == "attention":
                    q = rms((x @ w[p + "self_attn.q_proj.weight"].T).view(b, heads, hd), w[p + "self_attn.q_norm.weight"], eps)
                    kin = torch.cat([ctx, x])
                    k = rms((kin @ w[p + "self_attn.k_proj.weight"].T).view(c + b, kv_heads, hd),
                             w[p + "self_attn.k_norm.weight"], eps)
                    v = (kin @ w[p + "self_attn.v_proj.weight"].T).view(c + b, kv_heads, hd)
                    q, k = rope(q, pos[c:]), rope(k, pos)
                    rep = heads // kv_heads
                    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, 1)) / math.sqrt(hd)
                    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
                    y = torch.einsum("hqk,khd->qhd", probs, v.repeat_interleave(rep, 1)).reshape(b, heads * hd)
                    y = y @ w[p + "self_attn.o_proj.weight"].T
                else:
                    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
                    y = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
                h = h + _convolve(y, dynamic[:, 1], w[conv + "base_kernel"][1], groups)
        return rms(h, w["norm.weight"], eps)[1:]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on draft rows, times output_multiplier, soft-capped where set."""
        logits = hidden @ self.head.T * self.dcfg.get("output_multiplier", 1.0)
        cap = self.dcfg.get("final_logit_softcapping")
        return torch.tanh(logits / cap) * cap if cap is not None and cap > 0 else logits

    def select(self, hidden: torch.Tensor, anchor: int) -> list[int]:
        """The selector's argmax walk over the LM head's top-k candidates of each row."""
        unary, candidates = torch.topk(self.logits(hidden), self.dcfg["selector_top_k"], dim=-1, sorted=False)
        projected = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        before, after = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        path, previous = [], anchor
        for j in range(hidden.shape[0]):
            scores = unary[j] + (before[previous] * projected[j] * after[candidates[j]]).sum(-1)
            previous = int(candidates[j, int(torch.argmax(scores))])
            path.append(previous)
        return path

    def select_sampled(self, hidden: torch.Tensor, anchor: int, temperature: float, gen: torch.Generator):
        """The selector at T > 0: each position samples softmax(scores / T) over its candidates.
        Returns (path, candidates `[N, k]`, q `[N, k]`)."""
        unary, candidates = torch.topk(self.logits(hidden), self.dcfg["selector_top_k"], dim=-1, sorted=False)
        projected = hidden @ self.w["candidate_selector.hidden_projection.weight"].T
        before, after = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        path, qs, previous = [], [], anchor
        for j in range(hidden.shape[0]):
            q = torch.softmax((unary[j] + (before[previous] * projected[j] * after[candidates[j]]).sum(-1)) / temperature, -1)
            previous = int(candidates[j, int(torch.multinomial(q, 1, generator=gen))])
            path.append(previous)
            qs.append(q)
        return path, candidates, torch.stack(qs)

    def sampled_acceptance(self, prompt: list[int], max_new: int, temperature: float, seed: int) -> list[int]:
        """`dflash_generate` at T > 0 (the reference's rule: the selector samples its path, the target
        accepts each proposal with min(1, p / q), the residual max(p - q, 0) gives the next token).
        Returns the accepted proposals per full-block step."""
        gen = torch.Generator().manual_seed(seed)
        block, mask = self.dcfg["block_size"], self.dcfg["mask_token_id"]
        out = list(prompt)
        out.append(int(torch.multinomial(torch.softmax(self.target(out)[0][-1] / temperature, -1), 1, generator=gen)))
        start, end, accepted_per_step = len(prompt), len(prompt) + max_new, []
        while start + block < end:
            _, taps = self.target(out[:start])
            hidden = self.draft_hidden(taps, self.embed[[out[start]] + [mask] * (block - 1)])
            path, candidates, q = self.select_sampled(hidden, out[start], temperature, gen)
            p = torch.softmax(self.target(out[:start + 1] + path)[0][start:] / temperature, -1)
            accepted = 0
            while accepted < block - 1:
                j, token = accepted, path[accepted]
                q_token = float(q[j][candidates[j] == token].sum())
                if float(torch.rand((), generator=gen, dtype=F64)) * q_token >= float(p[j, token]):
                    break
                accepted += 1
            if accepted == block - 1:
                bonus = int(torch.multinomial(p[-1], 1, generator=gen))
            else:
                residual = p[accepted].clone()
                residual.scatter_add_(0, candidates[accepted], -q[accepted])
                residual = residual.clamp_min(0)
                residual = residual / residual.sum() if float(residual.sum()) > 0 else p[accepted]
                bonus = int(torch.multinomial(residual, 1, generator=gen))
            accepted_per_step.append(accepted)
            out = out[: start + 1] + path[:accepted] + [bonus]
            start += accepted + 1
        return accepted_per_step

    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], list[tuple[list[int], int]]]:
        """`dflash_generate` at T = 0 without stop tokens: (new ids, per full-block step (proposals, accepted))."""
        block, mask = self.dcfg["block_size"], self.dcfg["mask_token_id"]
        out = list(prompt)
        logits, _ = self.target(out)
        out.append(int(logits[-1].argmax()))
        start, end, steps = len(prompt), len(prompt) + max_new, []
        while start + 1 < end:
            size = min(block, end - start)
            ids = [out[start]] + [mask] * (size - 1)
            _, taps = self.target(out[:start])
            hidden = self.draft_hidden(taps, self.embed[ids])
            ids[1:] = self.select(hidden, out[start])
            posterior = self.target(out[:start] + ids)[0][start:].argmax(-1).tolist()
            accepted = 0
            while accepted < size - 1 and ids[1 + accepted] == posterior[accepted]:
                accepted += 1
            if size == block:
                steps.append((ids[1:], accepted))
            out = out[:start] + ids[: accepted + 1] + [posterior[accepted]]
            start += min(accepted + 1, end - start - 1)
            out = out[: start + 1]
        return out[len(prompt): min(start + 1, end)], steps
