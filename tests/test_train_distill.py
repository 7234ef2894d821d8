"""train-draft's distillation (`--distill`): the distributions generation records are the target's
own, and the distillation terms are KL and total variation of them (the end-to-end run with
`--distill kl` is test_train.py's)."""

from __future__ import annotations

import pytest
import torch
from test_train import tiny_draft  # noqa: F401 (a fixture)


def test_recorded_distributions_are_the_targets_own(tmp_path):
    """The top-16 generation records at every response position is the target's plain next-token
    distribution: a teacher-forced fp32 forward gives the same ids and log-probabilities (fp16 rounding),
    for greedy responses (whose token is its top-1) and sampled ones (the temperature undone)."""
    from transformers import AutoModelForCausalLM

    from dflash_export.checkpoint.sources import embedded_target_dir
    from dflash_export.train.data import generate_dataset
    from dflash_export.train.teacher import DISTILL_TOPK

    prompts = [{"id": "a", "category": "chat", "prompt": "Name a color."}, {"id": "b", "category": "math", "prompt": "What is 3 + 4?"}]
    data = generate_dataset(embedded_target_dir(), prompts, (1, 27), tmp_path / "data", 8, 2, torch.device("cpu"),
                            show_progress=False, responses_per_prompt=2, sample_temperature=1.5)
    model = AutoModelForCausalLM.from_pretrained(embedded_target_dir(), dtype=torch.float32).eval()
    assert data["topk_ids"].shape == data["topk_logprobs"].shape == (data["offsets"][-1], DISTILL_TOPK)
    for i, s in enumerate(data["sequences"]):
        ids, p, rows = s["ids"], s["prompt_len"], slice(data["offsets"][i], data["offsets"][i + 1])
        top_ids, top_logp = data["topk_ids"][rows], data["topk_logprobs"][rows].float()
        assert (top_ids[:p] == -1).all() and (top_logp[:p] == 0).all()
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # row t predicts t + 1
        want_logp, want_ids = torch.topk(logp[p - 1 : len(ids) - 1], DISTILL_TOPK, dim=-1)
        assert torch.equal(top_ids[p:, :3].long(), want_ids[:, :3]), s["id"]  # (lower ranks may swap at near-ties)
        assert (top_logp[p:] - want_logp).abs().max() <= 2e-3 * want_logp.abs().max() + 1e-3, s["id"]
        if "#s" not in s["id"]:
            assert top_ids[p:, 0].tolist() == ids[p:], s["id"]  # greedy: each token is the target's top-1


def test_distillation_term_is_kl_and_tv_of_the_targets_distribution(tiny_draft):  # noqa: F811
    """kl: with a teacher all on the label, the term is the hard cross-entropy, so weight 1 gives the
    recipe's loss; tv: 1/2 sum |p - q| over the whole vocabulary; a weight of 0 ignores the teacher."""
    from dflash_export.train.loss import Distill, block_loss, distill_term

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=gen)
    labels = torch.randint(0, 12, (5,), generator=gen)
    sure = torch.stack([labels, (labels + 1) % 12], dim=1)
    one_hot_logp = torch.tensor([[0.0, -1e4]] * 5)
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    torch.testing.assert_close(distill_term(logits, sure, one_hot_logp, "kl"), ce)
    teacher_ids = torch.stack([torch.randperm(12, generator=gen)[:4] for _ in range(5)])
    teacher_logp = torch.log_softmax(torch.randn(5, 4, generator=gen), dim=-1)
    full_p = torch.zeros(5, 12).scatter(1, teacher_ids, teacher_logp.exp())
    want_tv = 0.5 * (full_p - torch.softmax(logits, dim=-1)).abs().sum(-1)
    torch.testing.assert_close(distill_term(logits, teacher_ids, teacher_logp, "tv"), want_tv)
    want_kl = -(full_p * torch.log_softmax(logits, dim=-1)).sum(-1)
    torch.testing.assert_close(distill_term(logits, teacher_ids, teacher_logp, "kl"), want_kl)

    draft, tspec = tiny_draft
    a, b = draft.spec.arch, draft.spec.block_size
    head = torch.randn(tspec.vocab_size, a.hidden_size, generator=gen)
    embed = torch.nn.Embedding(tspec.vocab_size, a.hidden_size)
    ids = torch.randint(0, tspec.vocab_size, (30,), generator=gen).tolist()
    feats = torch.randn(len(ids), len(draft.spec.target_layer_ids) * a.hidden_size, generator=gen)
    label_teacher = (torch.stack([torch.tensor(ids), (torch.tensor(ids) + 1) % tspec.vocab_size], dim=1),
                     torch.tensor([[0.0, -1e4]] * len(ids)))
    random_teacher = (torch.randint(0, tspec.vocab_size, (len(ids), 4), generator=gen), torch.randn(len(ids), 4, generator=gen))

    def loss(**kw):
        import random

        args = (draft, head, embed, ids, feats, 5, 4, b, tspec.vocab_size - 1, 7.0, random.Random(3), torch.device("cpu"))
        with torch.no_grad():
            return float(block_loss(*args, **kw)[0])

    hard = loss()
    assert loss(teacher=label_teacher, distill=Distill("kl", 1.0)) == pytest.approx(hard, rel=1e-6)
    assert loss(teacher=random_teacher, distill=Distill("kl", 0.0)) == hard
    assert loss(teacher=random_teacher, distill=Distill("kl", 0.5)) != pytest.approx(hard, rel=1e-3)
