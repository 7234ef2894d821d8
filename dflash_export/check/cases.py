"""The reference side of `check` (see check.py): four teacher-forced cases of the decoding loop with
fp32 PyTorch outputs, and their storage for a device without torch.

Cases: target PREFILL (a prompt, empty past), DRAFT_PREFILL (its taps as context), target VERIFY (last
token + the draft's block hidden states, on the prefill's caches) and DRAFT_STEP (a few verified rows
on the first draft call's K/V); without a DFlash draft (`build --draft none`) PREFILL and a VERIFY of
random proposal ids; with the target's MTP head MTP_PREFILL and MTP_STEP. A hybrid target's caches follow `runtime.graphs.recurrent`: the verify call
gets the prefill's returned states and its rows as pending rows.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_export.check.reference import reference_modules, reference_mtp
from dflash_export.nn.draft import DraftWithRows
from runtime.errors import DFlashError
from runtime.graphs.tree import chain_inputs
from runtime.manifest import (
    draft_proposes,
    gdn_io_names,
    greedy_form_exported,
    layer_types,
)


@dataclass
class Case:
    """One graph call: its inputs (graph dtypes), the fp32 reference outputs, and id margins."""

    graph: str
    name: str
    feed: "OrderedDict[str, np.ndarray]"
    ref: dict[str, np.ndarray] = field(default_factory=dict)
    margins: dict[str, np.ndarray] = field(default_factory=dict)


def _torch_args(feed: dict) -> list:
    """A feed's arrays as torch tensors (floats as fp32), in order."""
    import torch

    return [torch.from_numpy(np.ascontiguousarray(a.astype(np.float32) if a.dtype.kind == "f" else a)) for a in feed.values()]


def run_module(module, feed: dict) -> list[np.ndarray]:
    """Run a PyTorch module on a feed (floats as fp32); its outputs as numpy arrays."""
    import torch

    with torch.no_grad():
        outs = module(*_torch_args(feed))
    return [o.detach().numpy() for o in outs]


def _margins(logits: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 logit per row (how clearly the argmax is decided)."""
    if logits.shape[0] == 0 or logits.shape[-1] < 2:
        return np.full(logits.shape[:1], np.inf, np.float32)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]).astype(np.float32)


def _rank_gaps(scores, ranks: int) -> np.ndarray:
    """fp32 `[R, ranks]`: for torch `scores [R, V]`, how clearly each of the top-`ranks` holds its rank
    (the least score gap to the candidate above or below it)."""
    import torch

    top = torch.topk(scores, min(ranks + 1, scores.shape[-1]), dim=-1).values.numpy()
    gaps = top[:, :-1] - top[:, 1:]  # rank k against rank k + 1
    if gaps.shape[1] < ranks:  # a vocabulary of exactly `ranks` ids: the last rank has nothing below
        gaps = np.concatenate([gaps, np.full((gaps.shape[0], 1), np.inf, np.float32)], axis=1)
    above = np.concatenate([np.full((gaps.shape[0], 1), np.inf, np.float32), gaps[:, :-1]], axis=1)
    return np.minimum(gaps[:, :ranks], above[:, :ranks]).astype(np.float32)


def _rank_margins(dmod, feed: dict, ranks: int) -> np.ndarray:
    """fp32 `[R, ranks]`: a proposing draft's `_rank_gaps` over its proposal head's scores (logits, so
    the gaps are those of the log-probabilities)."""
    import torch

    with torch.no_grad():
        hidden = DraftWithRows.forward(dmod, *_torch_args(feed))[0]
        return _rank_gaps(dmod.proposal_scores(hidden).to(torch.float32), ranks)


def _selector_margins(dmod, feed: dict, ranks: int) -> np.ndarray:
    """fp32 `[R, ranks]`: how clearly a DFlash 2 draft's returned candidates are decided: the least of
    their selector score gaps (`_rank_gaps`), the LM head's gap at the top-k boundary (which candidates
    exist at all), and every earlier row's choice (a row is scored given the choice before it)."""
    import torch

    context, block, rows, anchor, *past = _torch_args(feed)
    with torch.no_grad():
        hidden = dmod.hidden_rows(context, block, *past)[0]
        logits = dmod.logits(hidden)
        scores = dmod.candidate_selector.walk(hidden, logits, anchor)[2]
        top_k = dmod.candidate_selector.top_k
        gaps = _rank_gaps(scores, ranks)
        if top_k < logits.shape[1]:
            edge = torch.topk(logits, top_k + 1, dim=-1).values.numpy()
            gaps = np.minimum(gaps, (edge[:, -2] - edge[:, -1])[:, None])
    earlier = np.concatenate([[np.inf], np.minimum.accumulate(gaps[:, 0])[:-1]]).astype(np.float32)
    return np.minimum(gaps, earlier[:, None])[rows.numpy()]


def reference_cases(artifact_dir: Path, manifest: dict, prompt_len: int | None = None, seed: int = 0, modules=None) -> list[Case]:
    """The four teacher-forced cases with fp32 PyTorch reference outputs (see the module doc)."""
    import torch

    tmod, dmod = modules or reference_modules(manifest, artifact_dir)
    io = manifest["io"]
    dt = {g: {t["name"]: np.dtype(t["dtype"]) for t in io[g]["inputs"]} for g in io}
    out_names = {g: [t["name"] for t in io[g]["outputs"]] for g in io}
    t, d = manifest["target"], manifest["draft"]
    S, B = int(manifest["max_seq_len"]), int(d["block_size"])
    hidden, vocab = int(t["hidden_size"]), int(t["vocab_size"])
    T = int(prompt_len or min(13, max(1, S - B)))
    if T < 1 or T + B > S:
        raise DFlashError(f"--prompt-len {T} does not fit: prompt + block ({T} + {B}) must be <= max_seq_len {S}")
    rng = np.random.default_rng(seed)

    def feed(graph, **arrays):
        f = OrderedDict()
        for spec in io[graph]["inputs"]:
            f[spec["name"]] = np.ascontiguousarray(arrays[spec["name"]]).astype(dt[graph][spec["name"]])
        return f

    def run(graph, name, f, module):
        outs = dict(zip(out_names[graph], run_module(module, f)))
        return Case(graph, name, f, {k: (v.astype(np.float32) if v.dtype.kind == "f" else v) for k, v in outs.items()})

    def kv(prefix_outs, rows, layers, kvh, hd):
        arrays = {}
        for i in range(layers):
            for kind in ("key", "value"):
                src = prefix_outs.get(f"{kind}_{i}") if prefix_outs is not None else None
                arrays[f"past_{kind}_{i}"] = src[:rows] if src is not None else np.zeros((0, kvh, hd), np.float32)
        return arrays

    ids = rng.integers(0, vocab, size=T).astype(np.int64)
    # the verify case is greedy as the runtime binds it: no uniforms where the graph allows it (the
    # prefill case keeps one, so both forms are compared; BackendRunner adds them for engines that need them)
    greedy_rows = 0 if greedy_form_exported(manifest) else B

    proposes = draft_proposes(manifest)
    prefill = run("target", "prefill", feed(
        "target", input_ids=ids, draft_hidden=np.zeros((0, hidden)), proposal_ids=np.zeros(0, np.int64),
        temperature=np.zeros(1), uniform=np.zeros(1), **chain_inputs(0), **target_caches(t, None, 0)), tmod)
    head = _mtp_cases(manifest, rng, T, hidden, vocab, feed, run) if "mtp" in io else []
    if dmod is None:
        return _target_cases(prefill, rng, vocab, B, T, t, greedy_rows, feed, run, tmod) + head
    dl, dkv, dhd = int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"])
    mask_row = np.load(Path(artifact_dir) / manifest["mask_embedding"]).astype(np.float32)
    block = np.concatenate([prefill.ref["next_embeddings"][:1], np.broadcast_to(mask_row, (B - 1, hidden))])
    dprefill = run("draft", "draft_prefill", feed(
        "draft", context_hidden=prefill.ref["taps"], block_embeddings=block, proposal_rows=np.arange(B - 1),
        anchor_ids=prefill.ref["next_ids"][:1], **kv(None, 0, dl, dkv, dhd)), dmod)
    proposals = ({"proposal_ids": dprefill.ref["draft_top_ids"][:, 0]} if proposes
                 else {"draft_hidden": dprefill.ref["draft_hidden"]})
    verify = run("target", "verify", feed(
        "target", input_ids=prefill.ref["next_ids"][:1], **proposals, temperature=np.zeros(1),
        uniform=np.zeros(greedy_rows), **chain_inputs(B - 1), **target_caches(t, prefill.ref, T)), tmod)
    if not proposes:
        with torch.no_grad():
            prop_logits = tmod.logits_of(torch.from_numpy(verify.feed["draft_hidden"].astype(np.float32)))
            if tmod.draft_vocab is not None:  # proposals are an argmax over the draft vocabulary's rows only
                prop_logits = prop_logits[:, tmod.draft_vocab]
            prop_logits = prop_logits.numpy()
        verify.margins["proposal_ids"] = _margins(prop_logits)
    c = min(3, B)  # as if c - 1 proposals were accepted: the next context is c verified rows
    block2 = np.concatenate([verify.ref["next_embeddings"][c - 1 : c], np.broadcast_to(mask_row, (B - 1, hidden))])
    dstep = run("draft", "draft_step", feed(
        "draft", context_hidden=verify.ref["taps"][:c], block_embeddings=block2,
        proposal_rows=np.arange(min(2, B - 1)),  # a step verifying 2 proposals: the last layer cut to them
        anchor_ids=verify.ref["next_ids"][c - 1 : c], **kv(dprefill.ref, T, dl, dkv, dhd)), dmod)
    for case in (prefill, verify):
        case.margins["next_ids"] = _margins(case.ref["logits"])
    if proposes:
        for case in (dprefill, dstep):
            ranks = case.ref["draft_top_ids"].shape[1]
            case.margins["draft_top_ids"] = (_selector_margins(dmod, case.feed, ranks) if "anchor_ids" in case.feed
                                             else _rank_margins(dmod, case.feed, ranks))
    return [prefill, dprefill, verify, dstep] + head


def _mtp_cases(manifest: dict, rng, T: int, hidden: int, vocab: int, feed, run) -> list[Case]:
    """The MTP head's cases: MTP_PREFILL (T entries of random ids and hidden states, no past) and MTP_STEP
    (one chained entry, its own output state, on those entries' K/V)."""
    import torch

    module = reference_mtp(manifest)
    t = manifest["target"]
    kvh, hd = int(t["num_kv_heads"]), int(t["head_dim"])
    empty = np.zeros((0, kvh, hd), np.float32)
    first = run("mtp", "mtp_prefill", feed("mtp", input_ids=rng.integers(0, vocab, size=T),
                                           hidden=rng.standard_normal((T, hidden)), past_key=empty, past_value=empty),
                module)
    step = run("mtp", "mtp_step", feed("mtp", input_ids=first.ref["next_ids"], hidden=first.ref["mtp_hidden"],
                                       past_key=first.ref["key"], past_value=first.ref["value"]), module)
    for case in (first, step):
        with torch.no_grad():
            logits = torch.nn.functional.linear(torch.from_numpy(case.ref["mtp_hidden"]), module.head_weight().float())
        case.margins["next_ids"] = _margins(logits.numpy())
    del module
    return [first, step]


def _target_cases(prefill: Case, rng, vocab: int, B: int, T: int, t: dict, greedy_rows: int, feed, run, tmod) -> list[Case]:
    """The cases of an artifact without a DFlash draft (`build --draft none`): the prefill, then a verify
    call of B - 1 random proposal ids (as the MTP head's chain reaches the target) on its caches."""
    verify = run("target", "verify", feed(
        "target", input_ids=prefill.ref["next_ids"][:1], proposal_ids=rng.integers(0, vocab, size=B - 1),
        temperature=np.zeros(1), uniform=np.zeros(greedy_rows), **chain_inputs(B - 1),
        **target_caches(t, prefill.ref, T)), tmod)
    for case in (prefill, verify):
        case.margins["next_ids"] = _margins(case.ref["logits"])
    return [prefill, verify]


def save_reference(path: Path, cases: list[Case], manifest: dict) -> None:
    """Store the cases (inputs, fp32 reference outputs, margins) for a device without torch."""
    arrays = {}
    meta = {"format": "dflash_export.check.parity-reference", "sources": manifest.get("sources"), "cases": []}
    for i, c in enumerate(cases):
        meta["cases"].append({"graph": c.graph, "name": c.name, "inputs": list(c.feed), "outputs": list(c.ref),
                              "margins": list(c.margins)})
        for kind, dct in (("in", c.feed), ("ref", c.ref), ("margin", c.margins)):
            for k, v in dct.items():
                arrays[f"{i}/{kind}/{k}"] = v
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_reference(path: Path, manifest: dict) -> list[Case]:
    try:
        data = np.load(path, allow_pickle=False)
        meta = json.loads(bytes(data["meta"]).decode())
    except (OSError, ValueError, KeyError) as exc:
        raise DFlashError(f"{path} is not a reference saved by `check --save-reference` ({exc})") from None
    if meta.get("format") != "dflash_export.check.parity-reference" or meta.get("sources") != manifest.get("sources"):
        raise DFlashError(f"{path} was saved for another artifact (its sources differ); save it again for this one")
    cases = []
    graph_inputs = {g: [t["name"] for t in manifest["io"][g]["inputs"]] for g in manifest.get("io", {})}
    for i, c in enumerate(meta["cases"]):
        if c["graph"] in graph_inputs and list(c["inputs"]) != graph_inputs[c["graph"]]:
            raise DFlashError(f"{path} was saved for an earlier build of this artifact (its {c['graph']} inputs "
                              "differ from the graph's); save it again with `check --save-reference`")
        cases.append(Case(
            c["graph"], c["name"],
            OrderedDict((k, data[f"{i}/in/{k}"]) for k in c["inputs"]),
            {k: data[f"{i}/ref/{k}"] for k in c["outputs"]},
            {k: data[f"{i}/margin/{k}"] for k in c["margins"]},
        ))
    return cases


def target_caches(target: dict, previous: dict | None, rows: int) -> dict[str, np.ndarray]:
    """The target's cache inputs after a call with outputs `previous` (None: the first call) whose first
    `rows` rows were committed: K/V rows [0, rows) for attention layers; for a hybrid's Gated DeltaNet
    layers the states that call returned and its first `rows` recorded rows as pending rows
    (`runtime.graphs.recurrent`). `target` is the manifest's target section."""

    kvh, hd = int(target["num_kv_heads"]), int(target["head_dim"])
    out = {}
    for i, kind in enumerate(layer_types(target)):
        if kind == "full_attention":
            for name in ("key", "value"):
                out[f"past_{name}_{i}"] = previous[f"{name}_{i}"][:rows] if previous is not None else np.zeros((0, kvh, hd), np.float32)
            continue
        names_in, names_out = gdn_io_names(i)
        if previous is not None:
            out.update(zip(names_in[:2], (previous[names_out[0]], previous[names_out[1]])))
            out.update(zip(names_in[2:], (previous[name][:rows] for name in names_out[2:])))
            continue
        g = target["gdn"]
        hv, conv = int(g["num_value_heads"]), int(g["conv_dim"])
        out.update(zip(names_in, (np.zeros((int(g["conv_kernel"]) - 1, conv), np.float32),
                                  np.zeros((hv, int(g["key_head_dim"]), int(g["value_head_dim"])), np.float32),
                                  np.zeros((0, conv), np.float32), np.zeros((0, hv), np.float32), np.zeros((0, hv), np.float32))))
    return out
