"""Each K3 switch off gives bit-for-bit the Kimi Linear model; each switch on changes it (docs/model.md §7)."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, config_from_dict
from tests.model.helpers import randomize, raw_config, tokens

from .helpers import K3_ON, with_fields

# The explicit "off" value of every switch (absent fields are off too).
OFF = {
    "linear_attn_config.gate_lower_bound": None,
    "linear_attn_config.use_full_rank_gate": False,
    "mla_use_output_gate": False,
    "attn_res_block_size": None,
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "hidden_act": "silu",
    "activation_situ_beta": 2.0,         # ignored while hidden_act is silu
    "activation_situ_linear_beta": 9.0,
}


def logits(raw: dict, state: dict | None, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model = KimiLinearForCausalLM(config_from_dict(raw))
    if state is None:
        randomize(model, seed=21)
    else:
        model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model(ids).logits, model.state_dict()


def test_every_switch_off_is_bit_for_bit_kimi_linear():
    base = raw_config("KKMKM", routed_scaling_factor=1.0)
    ids = tokens(2, 17, seed=22)
    ref, state = logits(base, None, ids)
    for field, value in OFF.items():
        out, s = logits(with_fields(base, {field: value}), state, ids)
        assert list(s) == list(state), field
        assert torch.equal(out, ref), field
    out, _ = logits(with_fields(base, OFF), state, ids)
    assert torch.equal(out, ref)
    # use_latent_moe: false turns LatentMoE off even with a width given (as in K3 config files)
    out, _ = logits(with_fields(base, {"use_latent_moe": False, "routed_expert_hidden_size": 24}), state, ids)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("field", [f for f in K3_ON if f != "latent_moe_use_norm"])
def test_each_switch_on_changes_the_model(field):
    """On, each switch adds parameters or (same parameters) changes the logits: the off test is not vacuous."""
    base = raw_config("KKMKM", routed_scaling_factor=1.0)
    ids = tokens(2, 17, seed=23)
    ref, state = logits(base, None, ids)
    model = randomize(KimiLinearForCausalLM(config_from_dict(with_fields(base, {field: K3_ON[field]}))), seed=21)
    new = set(model.state_dict()) - set(state)
    if not new:
        model.load_state_dict(state, strict=True)
        with torch.no_grad():
            assert (model(ids).logits - ref).abs().max() > 1e-3
    else:
        expect = {"linear_attn_config.use_full_rank_gate": "self_attn.g_proj",
                  "mla_use_output_gate": "self_attn.g_proj", "attn_res_block_size": "res_proj",
                  "routed_expert_hidden_size": "routed_expert_down_proj"}[field]
        assert any(expect in n for n in new), (field, sorted(new)[:4])
