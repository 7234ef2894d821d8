"""Cost of exact speculative rollback for one Gated DeltaNet (GDN) layer, under three designs.

A verify step runs T = 1 + N rows (N proposals) of which acc + 1 = P are committed. Designs:
  (a) lagged fold (this project, `dflash_export/qwen3_5.py`): the call first folds the previous step's P
      committed rows into the state (`gated_delta_chunk`, state only), then computes its own T rows'
      outputs from it (outputs only); the state is returned once.
  (b) per-row state outputs: one call computes the T rows' outputs and the state after EVERY row; the
      runtime keeps the state after row P. Timed in chunk form and as the token-by-token recurrence.
  (c) recompute in a second call: the T rows' outputs, then a separate call folding the P accepted rows.
Measured: only the delta-rule math (projections, conv and norms are the same in every design), PyTorch
fp32 on CPU, median of --reps runs. Bytes are analytical (state fp32; conv state and rows fp16).
Shapes are ASSUMED (Qwen3.5-4B-like; not read from a checkpoint); change them with the flags.

    .venv/bin/python scripts/gdn_rollback_bench.py [--reps 30] [--threads 1] [--hidden 2560] \
        [--k-heads 16] [--v-heads 32] [--head-dim 128] [--gdn-layers 24]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

import torch

from dflash_export.nn import gated_delta as gd

MIB = 1 << 20


def chunk_all_states(q, k, v, g, beta, state):
    """`gated_delta_chunk`'s WY math returning the outputs and the state after every row:
    (o `[n, Hv, dv]`, states `[Hv, n, dk, dv]`), state_i = exp(cum_i) S0 + sum_{j<=i} decay_ij k_j v_new_j^T."""
    f32, n, hv = torch.float32, v.shape[0], v.shape[1]
    k = gd._expand_heads(k, hv).transpose(0, 1)
    v, beta, g = v.transpose(0, 1), beta.transpose(0, 1)[..., None], g.transpose(0, 1)
    cum = torch.cumsum(g, dim=1)
    idx = torch.arange(n)
    causal = idx[None, :] <= idx[:, None]
    later = torch.where(idx[:, None] > idx[None, :], g[:, :, None], torch.zeros((), dtype=f32))
    decay = torch.exp(torch.where(causal, torch.cumsum(later, dim=1), torch.finfo(f32).min))
    kk = torch.bmm(k, k.transpose(1, 2))
    inv = gd._unit_lower_inverse(torch.where(idx[None, :] < idx[:, None], -(beta * kk * decay), torch.zeros(())))
    w = torch.bmm(inv, k * beta * torch.exp(cum)[..., None])
    v_new = torch.bmm(inv, v * beta) - torch.bmm(w, state)
    qs = gd._expand_heads(q, hv).transpose(0, 1) * (q.shape[-1] ** -0.5)
    out = torch.bmm(qs * torch.exp(cum)[..., None], state) + torch.bmm(torch.bmm(qs, k.transpose(1, 2)) * decay, v_new)
    kd = (decay[..., None] * k[:, None]).transpose(-1, -2).reshape(hv * n, k.shape[-1], n)  # [Hv i, dk, j]
    s0 = (torch.exp(cum)[..., None, None] * state[:, None]).reshape(hv * n, *state.shape[1:])
    states = torch.baddbmm(s0, kd, v_new[:, None].expand(hv, n, n, v.shape[-1]).reshape(hv * n, n, -1))
    return out.transpose(0, 1), states.view(hv, n, *state.shape[1:])


def recurrent_all_states(q, k, v, g, beta, state):
    """Token by token (transformers' `torch_recurrent_gated_delta_rule`), keeping every state."""
    hv, dk = v.shape[1], k.shape[-1]
    k, q = gd._expand_heads(k, hv), gd._expand_heads(q, hv) * dk ** -0.5
    outs, states, s = [], [], state
    for t in range(v.shape[0]):
        s = s * torch.exp(g[t])[:, None, None]
        err = (v[t] - torch.bmm(k[t][:, None], s)[:, 0]) * beta[t][:, None]  # [Hv, dv]
        s = s + k[t][:, :, None] * err[:, None, :]
        outs.append(torch.bmm(q[t][:, None], s)[:, 0])
        states.append(s)
    return torch.stack(outs), torch.stack(states, dim=1)


def rows(n, a, gen):
    """Random GDN inputs for n rows: L2-normalised q, k; v; g = -exp(A_log) softplus(a + dt_bias); beta."""
    hk, hv, dk, dv = a.k_heads, a.v_heads, a.head_dim, a.head_dim
    q = gd.l2_normalize(torch.randn(n, hk, dk, generator=gen))
    k = gd.l2_normalize(torch.randn(n, hk, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    a_log = torch.log(torch.linspace(1.0, 8.0, hv))
    g = -torch.exp(a_log) * gd.softplus(torch.randn(n, hv, generator=gen) + 1.0)
    return q, k, v, g, torch.sigmoid(torch.randn(n, hv, generator=gen))


def median_ms(fns, reps):
    """Median ms of each of `fns`, timed in interleaved rounds (drift and warm-up hit all alike)."""
    for fn in fns * 3:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def keep_heap() -> bool:
    """glibc: serve and keep big blocks on the heap (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), so a 2 MiB
    tensor is not mmapped and page-faulted anew each call (that was about a third of the run, as system time)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 256 * MIB) and libc.mallopt(-1, 1024 * MIB))
    except (OSError, AttributeError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128, help="key and value head dim")
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--gdn-layers", type=int, default=24)
    ap.add_argument("--proposals", type=int, nargs="+", default=[3, 7, 15])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(True)
    heap = keep_heap()
    gen = torch.Generator().manual_seed(0)
    hv, dk, dv, L = a.v_heads, a.head_dim, a.head_dim, a.gdn_layers
    conv_dim = 2 * a.k_heads * dk + hv * dv
    S = hv * dk * dv * 4  # recurrent state, fp32
    C = (a.conv_kernel - 1) * conv_dim * 2  # conv state, fp16
    R = (conv_dim + 2 * hv) * 2  # one recorded row (pre-conv qkv, a, b), fp16
    mixer_w = 2 * a.hidden * (conv_dim + hv * dv + 2 * hv) + 2 * hv * dv * a.hidden
    print(f"ASSUMED shape (Qwen3.5-4B-like, not read from a checkpoint): hidden {a.hidden}, GDN key heads "
          f"{a.k_heads} x {dk}, value heads {hv} x {dv}, conv kernel {a.conv_kernel}, {L} GDN layers")
    print(f"per GDN layer: state {S / MIB:.2f} MiB fp32, conv state {C / 1024:.0f} KiB, recorded row "
          f"{R / 1024:.1f} KiB, mixer weights {mixer_w / MIB:.0f} MiB fp16 (read once per call in every design)")
    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} thread(s), median of {a.reps} (interleaved); "
          f"delta-rule math only; malloc kept on heap: {heap}\n")
    head = (f"{'N':>3} {'T':>3} {'design':<34} {'P':>3} {'ms/layer':>9} {'ms x' + str(L):>8} "
            f"{'state MiB':>9} {'rows KiB':>8} {'MiB/layer':>9} {'MiB x' + str(L):>9}")
    print(head + "\n" + "-" * len(head))

    def line(n, t, name, p, ms, state_b, rows_b):
        tot = state_b + rows_b
        print(f"{n:>3} {t:>3} {name:<34} {p if p else '-':>3} {ms:9.3f} {ms * L:8.1f} {state_b / MIB:9.2f} "
              f"{rows_b / 1024:8.1f} {tot / MIB:9.2f} {tot * L / MIB:9.1f}")

    worst = 0.0
    for n in a.proposals:
        t, p_typ = 1 + n, n // 2 + 1
        if t > gd.MAX_ROWS:
            raise SystemExit(f"T = {t} > MAX_ROWS = {gd.MAX_ROWS}")
        state = torch.randn(hv, dk, dv, generator=gen) * 0.1
        q, k, v, g, beta = rows(t, a, gen)
        pend = {p: rows(p, a, gen) for p in sorted({p_typ, t})}
        cases = []  # (name, P, fn, state bytes, row bytes)
        for p, pr in pend.items():
            def lagged(pr=pr):
                _, s = gd.gated_delta_chunk(None, *pr[1:], state, outputs=False)
                return gd.gated_delta_chunk(q, k, v, g, beta, s, final_state=False)[0]
            # reads S + C + P rows, writes S + C + T rows
            cases.append(("(a) lagged fold (ours)", p, lagged, 2 * S + 2 * C, (p + t) * R))
        # reads S + C, writes T states and T conv states; the runtime keeps state P - 1 (a 2 MiB copy)
        for name, fn in (("(b) per-row states, chunk form", chunk_all_states),
                         ("(b) per-row states, recurrence", recurrent_all_states)):
            cases.append((name, 0, lambda fn=fn: fn(q, k, v, g, beta, state)[1][:, p_typ - 1].contiguous(),
                          S + C + t * (S + C), 0))
        for p in pend:
            def two_calls(p=p):
                o, _ = gd.gated_delta_chunk(q, k, v, g, beta, state, final_state=False)  # call 1
                return o, gd.gated_delta_chunk(None, k[:p], v[:p], g[:p], beta[:p], state, outputs=False)[1]  # call 2
            # call 1 reads S + C, writes T rows; call 2 reads S + C + P rows, writes S + C
            cases.append(("(c) second call (fold only)", p, two_calls, 3 * S + 3 * C, (t + p) * R))
        for (name, p, _, sb, rb), ms in zip(cases, median_ms([c[2] for c in cases], a.reps)):
            line(n, t, name, p, ms, sb, rb)
        print()
        _, ref = gd.gated_delta_chunk(None, k[:p_typ], v[:p_typ], g[:p_typ], beta[:p_typ], state, outputs=False)
        o_ref, _ = gd.gated_delta_chunk(q, k, v, g, beta, state, final_state=False)
        for fn in (chunk_all_states, recurrent_all_states):
            o, st = fn(q, k, v, g, beta, state)
            worst = max(worst, (st[:, p_typ - 1] - ref).abs().max().item(), (o - o_ref).abs().max().item())
    print(f"check: per-row states (chunk, recurrence) vs gated_delta_chunk, max |diff| {worst:.2e}")
    print("(b) writes T states per layer per step and keeps one (timed: the one after N // 2 + 1 rows).")
    print("(c) timed as a fold-only second graph of the recorded rows (a second launch per step); as a plain")
    print("    recompute (a target call over the accepted rows) it re-reads every weight of the model per step:")
    for label, gb in (("fp16", 8.0), ("int4", 2.2)):
        print(f"    assumed 4B model {label}: +{gb:.1f} GB of weights per step, vs {2 * S * L / 1e9:.3f} GB of "
              "GDN state read + write per step in (a)")
    print(f"\nmemory, fp16 KV, assumed 8 full-attention layers of 4 KV heads x 256: KV per 1024 tokens "
          f"{8 * 2 * 4 * 256 * 2 * 1024 / MIB:.1f} MiB; GDN state for {L} layers (recurrent + conv, any length) "
          f"{L * (S + C) / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
