"""The trainer's GPU setting, bf16 autocast, run on the CPU's autocast: every preset with routed experts trains
through it, and the router still decides in float32 (autocast would otherwise run its F.linear in bf16)."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.ops.moe import router_logits
from kimi_linear.train.trainer import forward_logits, lm_loss
from tests.model.helpers import randomize


def test_router_logits_stay_float32_under_autocast():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 32, generator=gen).bfloat16(), torch.randn(8, 32, generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router_logits(x, w)
    assert logits.dtype == torch.float32 and torch.equal(logits, x.float() @ w.T)


@pytest.mark.parametrize("preset", ["tiny", "k3-tiny"])
def test_forward_backward_under_bf16_autocast(preset):
    model = randomize(KimiLinearForCausalLM(preset_config(preset)), seed=7)
    assert any("experts" in n for n, _ in model.named_parameters()), "the preset must have routed experts"
    ids = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(8))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    ref = lm_loss(forward_logits(model, batch), batch["labels"])
    with torch.autocast("cpu", dtype=torch.bfloat16):             # as Trainer.train_step on CUDA
        logits = forward_logits(model, batch)
    loss = lm_loss(logits, batch["labels"])
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref.item()) < 0.05 * ref.item()
    router = [p for n, p in model.named_parameters() if n.endswith("moe.gate.weight")]
    assert router and all(p.dtype == torch.float32 and p.grad is not None and torch.isfinite(p.grad).all()
                          for p in router)
