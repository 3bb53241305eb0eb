"""SparseMoE with the fused MoE op and packed expert weights.

The Triton path runs under the interpreter on CPU tensors (the op's dispatch monkeypatched, as on a GPU it is by
device) and must equal the PyTorch layer, in eager steps and in the fixed-shape (CUDA-graph) step; packing must
leave names, shapes, values, ``state_dict()`` and checkpoints as they were, hold the experts' memory once, and be
noticed when a weight is replaced. Bar: float32, 1e-6 relative (max-abs); the two paths differ in summation order.
"""

from __future__ import annotations

import pytest
import torch

from kimi_linear import KimiLinearForCausalLM
from kimi_linear.layers import SiTUGLU, SparseMoE
from kimi_linear.layers.activation import silu_glu

from ..model.helpers import make_config
from ..model.helpers import randomize as randomize_model
from .test_layers import randomize, rel_err

pytest.importorskip("triton")


class Fused:
    """The Triton ``fused_moe`` standing in for the GPU dispatch while ``enabled``; ``calls``: rows of each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.enabled = True


@pytest.fixture
def fused(monkeypatch):
    """Route ``kimi_linear.ops.fused_moe`` to the Triton kernels for CPU tensors (on a GPU: by device)."""
    import kimi_linear.ops.moe as moe_op
    from kimi_linear.ops.triton.moe import fused_moe as tri

    state = Fused()

    def spy(*args, **kw):
        state.calls.append(args[0].shape[0])
        return tri(*args, **kw)

    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: spy if name == "fused_moe" and state.enabled else None)
    return state


def make_moe(latent: bool) -> SparseMoE:
    m = SparseMoE(32, 24, num_experts=6, top_k=2, num_shared_experts=1, routed_scaling_factor=2.5,
                  glu=SiTUGLU(2.0, 3.0) if latent else silu_glu, latent_size=16 if latent else None,
                  latent_norm=latent)
    m = randomize(m, 3).eval()
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(6, generator=torch.Generator().manual_seed(4)) * 0.3)
    m.pack()
    return m


def run(m: SparseMoE, x: torch.Tensor, static: bool) -> torch.Tensor:
    m.static_dispatch = static
    try:
        with torch.inference_mode():
            return m(x)
    finally:
        m.static_dispatch = False


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("latent", [False, True])
def test_fused_layer_matches_pytorch_layer(fused, latent, static):
    """SiLU experts, and LatentMoE with SiTU; one token and a batch; eager and fixed-shape steps."""
    m = make_moe(latent)
    for n in (1, 7):
        x = torch.randn(n, 32, generator=torch.Generator().manual_seed(n))
        fused.enabled, fused.calls = True, []
        got = run(m, x, static)
        assert fused.calls == [n]
        fused.enabled = False
        ref = run(m, x, static)
        assert fused.calls == [n] and rel_err(got, ref) < 1e-6


def test_replaced_weight_is_noticed(fused):
    """A weight replaced after packing breaks the views: the eager step falls back to the per-expert paths (no
    second copy of the experts), the fixed-shape step to a stacked copy; both still compute the new weights."""
    m = make_moe(False)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))
    assert m._packed_experts() is not None
    with torch.no_grad():
        m.experts[2].w3.weight.data = m.experts[2].w3.weight.data * 2.0     # new storage
    assert m._packed_experts() is None
    eager = run(m, x, static=False)
    assert fused.calls == []
    static = run(m, x, static=True)
    assert fused.calls == [5]
    assert rel_err(static, eager) < 1e-6
    m.pack()                                       # packs the new values
    assert m._packed_experts() is not None and rel_err(run(m, x, static=False), eager) < 1e-6


def test_shared_expert_rides_in_the_fused_op(fused):
    """With the shared expert stacked last, the fused op runs it (num_shared=1) and the layer adds nothing after;
    a shared expert of another width (two shared experts) is not stacked and runs on its own: both equal the
    PyTorch layer."""
    m = make_moe(False)
    assert m._packed_experts()[2]
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(9))
    got = run(m, x, static=False)
    assert fused.calls == [7]
    fused.enabled = False
    assert rel_err(got, run(m, x, static=False)) < 1e-6
    wide = randomize(SparseMoE(32, 24, num_experts=6, top_k=2, num_shared_experts=2), 3).eval()
    wide.pack()
    assert not wide._packed_experts()[2] and wide._packed_experts()[0].shape[0] == 6
    fused.enabled = True
    got = run(wide, x, static=False)
    fused.enabled = False
    assert rel_err(got, run(wide, x, static=False)) < 1e-6


def test_gradients_skip_the_fused_op(fused):
    """Training needs the parameters' gradients: the fused op (no backward) is not used then."""
    m = make_moe(False).train()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(6))
    m(x).square().sum().backward()
    assert fused.calls == [] and any(ex.w1.weight.grad is not None for ex in m.experts)


def test_pack_views_state_dict_and_memory():
    """After pack(): every expert weight, the shared expert's too (stacked last), is a view into one of two stacks
    (memory held once); state_dict names, shapes and values unchanged; CPU orientation kept (longer dimension
    contiguous); in-place loads write through; .double() re-packs; a repeated model-level pack keeps the views."""
    m = SparseMoE(32, 24, num_experts=4, top_k=2)
    randomize(m, 7)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.pack()
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    w13, w2, shared = m._packed_experts()
    assert shared and w13.shape == (5, 48, 32) and w2.shape == (5, 32, 24)
    sh = m.shared_experts
    assert torch.equal(w13[4], torch.cat([sh.gate_proj.weight, sh.up_proj.weight]))
    assert torch.equal(w2[4], sh.down_proj.weight) and sh.down_proj.weight.data_ptr() == w2[4].data_ptr()
    sh.pack()                                                   # what the model's optimize_layout calls next
    assert m._packed_experts() is not None and sh._pack.weight.data_ptr() == w13[4].data_ptr()
    expert_params = [p for ex in [*m.experts, sh] for p in ex.parameters()]
    storages = {p.untyped_storage().data_ptr() for p in expert_params}
    assert storages == {w13.untyped_storage().data_ptr(), w2.untyped_storage().data_ptr()}
    assert w13.untyped_storage().nbytes() + w2.untyped_storage().nbytes() == sum(p.nbytes for p in expert_params)
    for e, ex in enumerate(m.experts):
        assert torch.equal(w13[e], torch.cat([ex.w1.weight, ex.w3.weight])) and torch.equal(w2[e], ex.w2.weight)
        assert ex.w2.weight.stride() == (1, 32)            # [32, 24]: the longer dimension (32) contiguous
        assert ex._pack.weight.data_ptr() == w13[e].data_ptr()
    # load_state_dict copies in place: the stacks see the new values
    new = {k: torch.randn_like(v) for k, v in before.items()}
    m.load_state_dict(new)
    assert m._packed_experts() is not None and torch.equal(m._packed_experts()[1][3], new["experts.3.w2.weight"])
    m.double()
    w13d = m._packed_experts()[0]
    assert w13d.dtype == torch.float64 and m.experts[1].w1.weight.data_ptr() == w13d[1].data_ptr()


def test_model_checkpoint_round_trip_keeps_packing(tmp_path, fused):
    """A model packs its MoE layers on construction; save_pretrained writes plain tensors (no shared storage),
    load_pretrained packs again; the fused model's logits equal the PyTorch path's."""
    model = randomize_model(KimiLinearForCausalLM(make_config("KM")), 11).eval()
    moes = [mod for mod in model.modules() if isinstance(mod, SparseMoE)]
    assert moes and all(mod._packed_experts() is not None for mod in moes)
    model.save_pretrained(tmp_path)
    loaded = KimiLinearForCausalLM.from_pretrained(tmp_path)
    ref_sd, got_sd = model.state_dict(), loaded.state_dict()
    assert list(got_sd) == list(ref_sd) and all(torch.equal(got_sd[k], v) for k, v in ref_sd.items())
    moes = [mod for mod in loaded.modules() if isinstance(mod, SparseMoE)]
    assert all(mod._packed_experts() is not None for mod in moes)
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(12))
    with torch.inference_mode():
        got = loaded(ids).logits
    assert fused.calls                            # the MoE layers went through the fused op
    fused.enabled = False
    with torch.inference_mode():
        ref = model(ids).logits
    assert rel_err(got, ref) < 1e-5
