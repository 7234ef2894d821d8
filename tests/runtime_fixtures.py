"""Helpers for the runtime tests (test_decoding, test_errors, test_no_torch, test_cli).

Tiny target/draft pairs are exported ONCE per test run: `artifact(kind, tmp_path_factory)` caches by
kind at module level, so test files that each wrap it in their own session fixture still share one
build, and the build itself is shared by the xdist workers (`shared_cache.shared_dir`: built by the
first worker that needs it, read by all; tests copy an artifact before changing it). Kinds:

- "qwen3": random untied Qwen3 target (4 layers, GQA 4:2, head_dim 24) + random draft (block 8),
  max_seq_len 64, with a tiny word-level tokenizer ("t0" .. "t95", eos "</s>" = 2).
- "llama": random untied Llama target + random draft (block 4), max_seq_len 48.
- "ctxfree": a context-free target (tied embeddings, every o_proj and down_proj scaled to ~1e-7, so token t
  maps to argmax(E . norm(E[t])) = t) and a draft with the same near-zero o_proj/down_proj and unit norms
  (its output is norm(block embedding): position j >= 1 sees only the MASK embedding). With a prompt
  ending in the mask id the target emits the mask id and the draft proposes it: whole blocks accepted.

`Oracle` replaces a session's draft call with hidden rows whose target-lm_head argmax are chosen
tokens, so tests decide exactly which proposals are made (and hence accepted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from shared_cache import shared_dir

ROOT = Path(__file__).resolve().parents[1]  # the repository root, for subprocesses

VOCAB = 96
EOS = 2


def proposing_costs():
    """CPU-like step costs for policy tests on proposing pairs (`runtime.graphs.costs.CallCosts`): plain
    30 ms; draft + verify n: 40 + 2n ms, of which the verify is 32 + 2n ms (draft 8 ms)."""
    from runtime.graphs.costs import CallCosts

    return CallCosts({0: 30.0, 1: 42.0, 3: 46.0, 7: 54.0, 15: 70.0}, 128, {1: 34.0, 3: 38.0, 7: 46.0, 15: 62.0})


@dataclass
class Pair:
    """A built tiny artifact and the checkpoints it came from."""

    kind: str
    target_dir: Path
    draft_dir: Path
    artifact: Path
    block_size: int
    mask_id: int
    max_seq_len: int


_ARTIFACTS: dict[str, Pair] = {}
_CHECKPOINTS: dict[str, Path] = {}
_HF: dict[str, object] = {}


# ---- checkpoints -------------------------------------------------------------------------------
def _near_zero_projections(state: dict) -> dict:
    """Every o_proj / down_proj weight scaled to ~1e-7: attention and MLP add (almost) nothing.

    Not exactly zero: the exporter refuses byte-identical large weights ("stored twice"), and all-zero
    matrices of the same shape in different layers would be identical.
    """
    rng = np.random.default_rng(0)
    return {
        k: (rng.standard_normal(v.shape).astype(v.dtype) * 1e-7 if ("o_proj" in k or "down_proj" in k) else v)
        for k, v in state.items()
    }


def add_word_tokenizer(target_dir: Path) -> None:
    """Save a word-level fast tokenizer over "t0".."t95" ("<unk>"=0, "<s>"=1, "</s>"=2) into target_dir."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<unk>": 0, "<s>": 1, "</s>": 2})
    del vocab["t0"], vocab["t1"], vocab["t2"]
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(target_dir))


def _patch_safetensors(path: Path, fn: Callable[[dict], dict]) -> None:
    from safetensors.numpy import load_file, save_file

    state = load_file(str(path))
    save_file(fn(state), str(path))


def checkpoints(kind: str, tmp_path_factory) -> Path:
    """A directory with the tiny checkpoints of `kind` (`target/`, `draft/`), made once per test run
    (shared by the xdist workers: read-only)."""
    if kind not in _CHECKPOINTS:
        if kind not in ("qwen3", "llama", "ctxfree"):
            raise KeyError(kind)
        _CHECKPOINTS[kind] = shared_dir(tmp_path_factory, f"rt_ckpt_{kind}", lambda root: _make_checkpoints(kind, root))
    return _CHECKPOINTS[kind]


def _make_checkpoints(kind: str, root: Path) -> None:
    import tiny_models

    if kind == "qwen3":
        t = tiny_models.make_target(root / "target", family="qwen3", tie=False, seed=0)
        add_word_tokenizer(t)
        tiny_models.make_draft(root / "draft", t, block_size=8, scale=0.15)
    elif kind == "llama":
        t = tiny_models.make_target(root / "target", family="llama", tie=False, seed=3)
        tiny_models.make_draft(root / "draft", t, block_size=4, scale=0.15)
    elif kind == "ctxfree":
        t = tiny_models.make_target(root / "target", family="qwen3", tie=True, seed=5)
        zero = _near_zero_projections
        _patch_safetensors(t / "model.safetensors", zero)
        mask = ctxfree_mask_id(t)
        d = tiny_models.make_draft(root / "draft", t, block_size=4, mask_token_id=mask)

        def zero_draft(st):
            st = zero(st)
            return {k: (np.ones_like(v) if k.endswith("norm.weight") else v) for k, v in st.items()}

        _patch_safetensors(d / "model.safetensors", zero_draft)


def ctxfree_mask_id(target_dir: Path) -> int:
    """Highest id t whose tied-embedding self score E[t].E[t] beats every other E[i].E[t] (so t -> t)."""
    E = lm_head_matrix(target_dir)
    fixed = np.flatnonzero(np.argmax(E @ E.T, axis=0) == np.arange(len(E)))
    assert fixed.size, "no token maps to itself in the context-free target"
    return int(fixed[-1])


DECODING_PROMPTS = ([5, 6, 7], [1, 40, 33, 12, 90, 7, 61, 18], [3])
REFERENCE_TOKENS = 48  # length of the plain-greedy reference continuations


def drain(handles) -> list[list[int]]:
    """Wait for each streamed generation of `handles` (BatchEngine.stream's) and return their output ids."""
    out = []
    for h in handles:
        for _ in h:
            pass
        out.append(h.result.output_ids)
    return out


def greedy_reference(pair: Pair):
    """`ref(prompt, n=None)`: the plain-greedy continuation (block_size 1, no stop ids) of `prompt` on the
    pair's artifact itself, `n` tokens (default: 48, or what fits), computed once per prompt and n."""
    import runtime

    sess = runtime.load(pair.artifact)
    cache = {}

    def ref(prompt, n=None):
        n = min(REFERENCE_TOKENS, pair.max_seq_len - len(prompt)) if n is None else n
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = sess.generate(list(prompt), max_new_tokens=n, stop_token_ids=[], block_size=1).output_ids
        return cache[key]

    return ref


def artifact(kind: str, tmp_path_factory) -> Pair:
    """The built artifact of `kind` (exported once per test run, shared by the xdist workers)."""
    if kind in _ARTIFACTS:
        return _ARTIFACTS[kind]
    import json

    from dflash_export.build import BuildOptions, build

    root = checkpoints(kind, tmp_path_factory)
    max_seq_len = {"qwen3": 64, "llama": 48, "ctxfree": 32}[kind]
    out = shared_dir(tmp_path_factory, f"rt_art_{kind}", lambda d: build(
        BuildOptions(str(root / "target"), str(root / "draft"), d / "artifact", max_seq_len=max_seq_len, quiet=True))) / "artifact"
    manifest = json.loads((out / "manifest.json").read_text())
    pair = Pair(
        kind=kind,
        target_dir=root / "target",
        draft_dir=root / "draft",
        artifact=out,
        block_size=int(manifest["draft"]["block_size"]),
        mask_id=int(manifest["draft"]["mask_token_id"]),
        max_seq_len=max_seq_len,
    )
    _ARTIFACTS[kind] = pair
    return pair


def proposing_artifact(kind: str, tmp_path_factory, every: int = 2) -> Pair:
    """`kind`'s pair with a proposal vocabulary (every `every`-th id, plus the mask id), so its draft
    graph ends in the proposal head (`runtime.manifest.draft_proposes`); built once per test run."""
    key = f"{kind}-proposing-{every}"
    if key in _ARTIFACTS:
        return _ARTIFACTS[key]
    import json
    import shutil

    from dflash_export.build import BuildOptions, build

    base = artifact(kind, tmp_path_factory)

    def make(root: Path) -> None:
        draft = root / "draft"
        shutil.copytree(base.draft_dir, draft)
        vocab_size = lm_head_matrix(base.target_dir).shape[0]
        ids = sorted({*range(0, vocab_size, every), base.mask_id})
        (draft / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
        build(BuildOptions(str(base.target_dir), str(draft), root / "artifact", max_seq_len=base.max_seq_len, quiet=True))

    root = shared_dir(tmp_path_factory, f"rt_art_{key}", make)
    draft = root / "draft"
    pair = Pair(kind=key, target_dir=base.target_dir, draft_dir=draft, artifact=root / "artifact",
                block_size=base.block_size, mask_id=base.mask_id, max_seq_len=base.max_seq_len)
    _ARTIFACTS[key] = pair
    return pair


# ---- reference computations (Hugging Face, numpy) -----------------------------------------------
def lm_head_matrix(target_dir: Path) -> np.ndarray:
    """The target's `[V, d]` LM head (the embedding table when tied), fp32, from its safetensors."""
    from safetensors.numpy import load_file

    st = load_file(str(Path(target_dir) / "model.safetensors"))
    return np.asarray(st.get("lm_head.weight", st["model.embed_tokens.weight"]), np.float32)


def hf_model(target_dir: Path):
    key = str(target_dir)
    if key not in _HF:
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        _HF[key] = model
    return _HF[key]


def _few_threads():
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():
        n = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matmuls: threads only add overhead on a loaded 2-core box
        try:
            yield
        finally:
            torch.set_num_threads(n)

    return ctx()


def hf_greedy(target_dir: Path, prompt: Sequence[int], n: int) -> tuple[list[int], np.ndarray]:
    """Hugging Face `generate` greedy (no stop token): (n new ids, top-2 logit margin at each step)."""
    import torch

    model = hf_model(target_dir)
    with _few_threads(), torch.no_grad():
        g = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = g.sequences[0, len(prompt) :].tolist()
    logits = torch.stack(g.logits)[:, 0].float().numpy()
    top2 = np.sort(logits, axis=1)[:, -2:]
    assert len(ids) == n
    return ids, top2[:, 1] - top2[:, 0]


def hf_greedy_violations(target_dir: Path, prompt: Sequence[int], out: Sequence[int], tol: float = 1e-3) -> list[int]:
    """Teacher-forced check of a greedy output: positions i where `out[i]` is not the argmax (within
    `tol`) of Hugging Face's logits after `prompt + out[:i]` (one forward over the whole sequence)."""
    import torch

    seq = [*prompt, *out]
    with _few_threads(), torch.no_grad():
        logits = hf_model(target_dir)(torch.tensor([seq])).logits[0].float().numpy()
    rows = logits[len(prompt) - 1 : len(seq) - 1]
    chosen = rows[np.arange(len(out)), np.asarray(out)]
    return [int(i) for i in np.flatnonzero(chosen < rows.max(axis=1) - tol)]


def hf_next_logits(target_dir: Path, ids: Sequence[int]) -> np.ndarray:
    """Hugging Face logits `[V]` of the token after `ids` (fp32)."""
    import torch

    with _few_threads(), torch.no_grad():
        return hf_model(target_dir)(torch.tensor([list(ids)])).logits[0, -1].float().numpy()


def softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    z = (x - x.max()) / temperature
    p = np.exp(z.astype(np.float64))
    return p / p.sum()


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, z: float = 4.0) -> tuple[bool, float, float]:
    """Pearson chi-square goodness of fit; bins with expected < 5 merged. Returns (ok, stat, threshold).

    The threshold is the Wilson-Hilferty upper quantile for `z` standard deviations (z = 4: p ~ 3e-5).
    """
    n = counts.sum()
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big).any():
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b, float), np.array(exp_b, float)
    keep = exp_b > 0
    assert (obs_b[~keep] == 0).all(), "a token with probability 0 was sampled"
    stat = float(((obs_b[keep] - exp_b[keep]) ** 2 / exp_b[keep]).sum())
    df = max(int(keep.sum()) - 1, 1)
    thr = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat <= thr, stat, float(thr)


# ---- decoding oracles ---------------------------------------------------------------------------
def expected_acceptance(max_new: int, block: int, correct: int | None = None) -> list[int]:
    """acceptance_lengths of a run with no stop: `correct` leading proposals right per step (None: all)."""
    out, acc = 1, []
    while out < max_new:
        n = min(block - 1, max_new - out - 1)
        a = n if correct is None else min(correct, n)
        if n > 0:
            acc.append(a + 1)
        out += a + 1
    return acc


def token_rows(target_dir: Path, scale: float = 8.0) -> np.ndarray:
    """`[V, d]` draft-hidden rows whose target-lm_head argmax is their own index (verified)."""
    W = lm_head_matrix(target_dir).astype(np.float64)
    rows = W.copy()
    bad = np.flatnonzero(np.argmax(W @ rows.T, axis=0) != np.arange(len(W)))
    if bad.size:  # least-squares rows aiming at one-hot logits for the tokens a plain row misses
        pinv = np.linalg.pinv(W)
        for t in bad:
            onehot = np.full(len(W), -1.0)
            onehot[t] = 1.0
            rows[t] = pinv @ onehot
    logits = W @ rows.T
    assert (np.argmax(logits, axis=0) == np.arange(len(W))).all(), "cannot build oracle rows for every token"
    return (rows * scale).astype(np.float32)


class Oracle:
    """Replace `sess.run_draft` by a writer of chosen proposals.

    `propose(k, n)` returns the n tokens to propose when k tokens have been generated (proposals are
    for output positions k .. k + n - 1). The draft-hidden rows are turned into `proposal_ids` by the
    target graph's own LM head, so everything downstream of the draft is the real runtime.
    """

    def __init__(self, sess, rows: np.ndarray, prompt_len: int, propose: Callable[[int, int], list[int]]):
        self.sess, self.rows, self.prompt_len, self.propose = sess, rows, prompt_len, propose
        self.calls: list[tuple[int, list[int]]] = []
        sess.run_draft = self._draft

    def _draft(self, n_context: int, past: int, block_size: int, taps_row: int = 0, rows=None) -> None:
        sess = self.sess
        k = past + n_context - self.prompt_len + 1  # tokens generated so far (cache + the anchor)
        toks = [int(t) for t in self.propose(k, block_size - 1)]
        assert len(toks) == block_size - 1
        self.calls.append((k, toks))
        hidden = self.rows[toks].astype(sess.dtype)
        if rows is not None and sess.proposal_rows is not None:  # as the graph: rows past `rows` not written
            hidden[rows:] = np.nan  # so a step reading a row its draft call did not compute goes wrong
        sess.backend.write(sess.draft_hidden.rows(0, block_size - 1), hidden)


def follow(ref: Sequence[int], correct: int | None = None) -> Callable[[int, int], list[int]]:
    """Proposals from a known continuation `ref`: the first `correct` right (None: all), the rest wrong."""

    def propose(k: int, n: int) -> list[int]:
        want = [ref[k + j] if k + j < len(ref) else 0 for j in range(n)]
        if correct is None:
            return want
        return [w if j < correct else (w + 1) % VOCAB for j, w in enumerate(want)]

    return propose


def build_leftovers(out: Path) -> list[str]:
    """Temporary siblings (`.NAME.tmp-*`, `.NAME.old-*`) of an artifact directory."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def no_partial_output(out: Path) -> None:
    """Assert that a failed build left neither `out` nor a `.out.tmp-*` / `.out.old-*` sibling."""
    out = Path(out)
    assert not out.exists(), f"{out} was left behind"
    assert not build_leftovers(out), f"temporary directories left behind: {build_leftovers(out)}"
