"""bench/long_context.py's arithmetic on the CPU: the two models' layouts (the 48B preset and its all-MLA twin),
the on-device build in the compute dtype (no float32 detour), the floors against hand counts, the largest batch,
and --plan on the real widths."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kimi_linear.model import preset_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import long_context  # noqa: E402
from floors import WeightSplit, decode_cache_bytes, prefill_flops  # noqa: E402
from long_context_model import (  # noqa: E402
    GiB,
    build,
    decode_reserve,
    largest_batch,
    meta_model,
    model_config,
    seq_cache_bytes,
)

WIDTHS = ("hidden_size", "vocab_size", "num_local_experts", "num_experts_per_tok", "kv_lora_rank",
          "num_attention_heads", "moe_intermediate_size", "intermediate_size", "linear_num_heads", "linear_head_dim")


def test_the_two_models_are_the_preset_and_its_all_mla_twin():
    preset = preset_config("kimi-linear-48b")
    hybrid, mla = (model_config(k, None, 1 << 20, False) for k in ("hybrid", "mla"))
    assert hybrid.layer_types == preset.layer_types and len(hybrid.layer_types) == 27
    assert mla.layer_types == ["full_attention"] * 27
    for field in WIDTHS:
        assert getattr(hybrid, field) == getattr(mla, field) == getattr(preset, field), field
    assert hybrid.max_position_embeddings == 1 << 20
    cut = model_config("hybrid", 8, 4096, False).layer_types
    assert [i for i, t in enumerate(cut) if t == "full_attention"] == [3, 7]
    with pytest.raises(ValueError, match="--model"):
        model_config("gdn", None, 4096, False)


class LargestFloat32(TorchDispatchMode):
    """Records the largest float32 tensor any operation produces."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.numel = max(self.numel, t.numel())
        return out


def test_build_never_makes_a_float32_copy_of_a_weight():
    config = model_config("hybrid", None, 4096, True)
    with LargestFloat32() as seen:
        model = build(config, "cpu", torch.bfloat16)
    router = config.num_local_experts * config.hidden_size              # the biggest weight kept in float32
    assert seen.numel <= router < config.vocab_size * config.hidden_size
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name.endswith((".gate.weight", ".dt_bias", ".A_log")) else torch.bfloat16)
    assert all(bool(torch.isfinite(p.float()).all()) for p in model.parameters())


def test_floors_against_hand_counts():
    model = meta_model(model_config("hybrid", None, 4096, True), torch.float32)
    c = model.config
    T, chunk = 1000, 256
    f = prefill_flops(model, T, chunk)
    qk, v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    assert f["mla_attention"] == c.num_attention_heads * 2 * (qk + v) * T * (T + 1) / 2        # one MLA layer
    assert f["lm_head"] == 2 * c.vocab_size * c.hidden_size * 4                               # 4 chunks' last token
    assert f["total"] == pytest.approx(f["linear"] + f["lm_head"] + f["mla_attention"] + f["kda"])
    w = WeightSplit.of(model)
    E, k = c.num_local_experts, c.num_experts_per_tok
    assert w.decode_bytes(1) == w.total - w.embedding + w.embedding_row - w.moe_layers * (E - k) * w.expert
    assert w.decode_bytes(10_000) == pytest.approx(w.total - w.embedding + 10_000 * w.embedding_row, rel=1e-6)
    H, d, W = c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim
    per_kda = 2 * H * d * d * 4 + 2 * (W - 1) * 3 * H * d * 4
    assert decode_cache_bytes(model, 2, 300) == 2 * (3 * per_kda + 300 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4)


def test_largest_batch_fills_the_free_memory_and_no_more():
    config = model_config("hybrid", None, 1 << 20, False)
    free, n = 48 * GiB, 131072
    b = largest_batch(free, config, n, 16, torch.bfloat16, 10_000)
    need = lambda b: b * seq_cache_bytes(config, n, 16, torch.bfloat16) + decode_reserve(config, b)
    assert 1 < b and need(b) <= free - 4 * GiB < need(b + 1)
    assert largest_batch(free, config, n, 16, torch.bfloat16, 3) == 3


def test_plan_on_the_real_widths(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["long_context.py", "--plan", "--model", "hybrid", "--layers", "4", "--check"])
    assert long_context.main() == 0
    out = capsys.readouterr().out
    assert "| decode | 1,048,576 | 1 |" in out and "| prefill | 1,048,576 | 1 |" in out and "check: ~" in out
    assert "| NO |" not in out
