"""The residual stream's RMSNorm and residual add + RMSNorm (ops.rms_norm): the PyTorch path against a float64
formula, and the Triton kernel (under the interpreter) against the PyTorch path with matching and mixed dtypes,
strided rows, row counts that are not a multiple of the kernel's row block and sizes that are not powers of two;
the dispatch (kernel only when no gradient is needed) and the argument checks.

Bars against the PyTorch path (the kernels differ from it only in the float32 reduction order and rsqrt):
float32 2e-6 relative per element; float16 and bfloat16 at most 1 ulp off on at most 0.5% of the elements (a
1-ulp different rsqrt can move a rounded product); the residual sum bit-equal to torch's add. The kernels round
with ``cast`` (to nearest even, also under the interpreter, whose plain float32 -> bfloat16 cast truncates).
"""

import pytest
import torch

import kimi_linear.ops.rms_norm as rms_op
from kimi_linear.ops.rms_norm import add_rms_norm, rms_norm, rms_norm_torch

from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)

EPS = 1e-6


def naive(x, weight, eps):
    """The module formula in float64 (no intermediate cast)."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def make(shape, dtype, wdtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3.0).to(dtype)
    w = (1.0 + 0.3 * torch.randn(shape[-1], generator=gen)).to(wdtype or dtype)
    return x, w


def assert_close_to_torch(got, ref, x_dtype):
    """The bars of the module docstring for inputs of x_dtype (the norm is cast to it), elementwise relative to
    the reference."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    g, r = got.double(), ref.double()
    rel = (g - r).abs() / r.abs().clamp_min(1e-30)
    if x_dtype == torch.float32:
        assert rel.max() < 2e-6, rel.max()
    else:
        ulp = 2.0**-10 if x_dtype == torch.float16 else 2.0**-7
        assert rel.max() <= ulp and (got != ref).double().mean() < 5e-3, (rel.max(), (got != ref).sum())


def test_torch_path_float64_and_dtypes():
    x, w = make((3, 5, 40), torch.float64)
    assert ((rms_norm(x, w, EPS) - naive(x, w, EPS)).abs().max() / naive(x, w, EPS).abs().max()) < 1e-12
    # 16-bit: normalised in float32, cast to x's dtype before the weight multiply; float32 weight -> float32 out
    xb, wb = make((4, 24), torch.bfloat16)
    want = wb * (naive(xb, torch.ones(24), EPS).float().bfloat16())
    assert torch.equal(rms_norm(xb, wb, EPS), want)
    assert rms_norm(xb, wb.float(), EPS).dtype == torch.float32


def triton_ops():
    from kimi_linear.ops.triton.rms_norm import add_rms_norm as tri_add
    from kimi_linear.ops.triton.rms_norm import rms_norm as tri

    return tri, tri_add


SHAPES = [(2, 7, 300), (37, 64), (1, 1, 2304), (5, 24)]   # D not a power of 2; 37 rows vs a 16-row block


@pytest.mark.parametrize("dtype, wdtype", [
    (torch.float32, None), (torch.float16, None), (torch.bfloat16, None),
    (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_torch_path(shape, dtype, wdtype):
    tri, tri_add = triton_ops()
    x, w = make(shape, dtype, wdtype, seed=1)
    assert_close_to_torch(tri(x, w, EPS), rms_norm_torch(x, w, EPS), dtype)
    delta = make(shape, dtype, seed=2)[0]
    s, y = tri_add(x, delta, w, EPS)
    assert torch.equal(s, x + delta)
    assert_close_to_torch(y, rms_norm_torch(s, w, EPS), dtype)     # the norm of the sum as the kernel stored it


def test_triton_strided_rows():
    """x a slice of a packed projection's output (MLA's latent before kv_a_layernorm): rows a stride apart."""
    tri, tri_add = triton_ops()
    packed, w = make((3, 4, 50), torch.float32, seed=3)
    w = w[:40].clone()
    x = packed[..., 5:45]
    assert not x.is_contiguous()
    assert_close_to_torch(tri(x, w, EPS), rms_norm_torch(x, w, EPS), x.dtype)
    s, y = tri_add(x, packed[..., 10:50], w, EPS)
    assert torch.equal(s, x + packed[..., 10:50]) and s.is_contiguous()
    assert_close_to_torch(y, rms_norm_torch(x + packed[..., 10:50], w, EPS), x.dtype)


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Dispatch to the Triton kernels for CPU tensors too (on a GPU the dispatch is by device); records the
    kernels that ran."""
    tri, tri_add = triton_ops()
    calls = []

    def pick(name, x):
        kernel = {"rms_norm": tri, "add_rms_norm": tri_add}[name]
        return lambda *args: calls.append(name) or kernel(*args)

    monkeypatch.setattr(rms_op, "triton_op", pick)
    return calls


def test_dispatch_kernel_only_without_grad(kernels_everywhere):
    x, w = make((6, 32), torch.float32, seed=4)
    delta = make((6, 32), torch.float32, seed=5)[0]
    with torch.no_grad():
        rms_norm(x, w.requires_grad_(), EPS)
        add_rms_norm(x, delta, w, EPS)
    assert kernels_everywhere == ["rms_norm", "add_rms_norm"]
    # under autograd the PyTorch path runs and gradients flow to x, delta and the weight
    xg, dg = x.clone().requires_grad_(), delta.clone().requires_grad_()
    s, y = add_rms_norm(xg, dg, w, EPS)
    (y.square().sum() + s.sum()).backward()
    assert kernels_everywhere == ["rms_norm", "add_rms_norm"]
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (xg, dg, w))
    # float64 and mixed-dtype adds stay on the PyTorch path
    with torch.no_grad():
        rms_norm(x.double(), w.detach().double(), EPS)
        add_rms_norm(x, delta.bfloat16(), w, EPS)
    assert kernels_everywhere == ["rms_norm", "add_rms_norm"]


@pytest.mark.parametrize("bad, match", [
    (dict(weight=torch.ones(5)), "weight must be"),
    (dict(weight=torch.ones(2, 8)), "weight must be"),
    (dict(delta=torch.zeros(2, 3, 7)), "delta must be"),
])
def test_bad_inputs(bad, match):
    args = dict(x=torch.zeros(2, 3, 8), delta=torch.zeros(2, 3, 8), weight=torch.ones(8))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        add_rms_norm(**args)


@pytest.mark.parametrize("dtype, wdtype", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.bfloat16, torch.float32)])
def test_rms_norm_write_scatters_entries(dtype, wdtype, monkeypatch):
    """An MLA decode step's entries ``[norm(latent) | rope]`` written at pool rows: the PyTorch path equals the
    norm, concatenation and index copy it replaces; the kernel (interpreter) equals the PyTorch path to the norm's
    bars, the rope columns copied bit for bit, and rows not named stay untouched (NaN-poisoned pool)."""
    from kimi_linear.ops.rms_norm import rms_norm_write
    from kimi_linear.ops.triton.rms_norm import rms_norm_write as tri

    packed, w = make((4, 60), dtype, wdtype, seed=9)
    w = w[:40].clone()
    x = packed[:, 2:58]                                             # [4, 56]: a strided view, 40 normed + 16 rope
    rows = torch.tensor([6, 0, 3, 9])
    want = torch.full((11, 56), float("nan"), dtype=dtype)
    want[rows] = torch.cat([rms_norm_torch(x[:, :40], w, EPS), x[:, 40:]], -1).to(dtype)
    ref = torch.full((11, 56), float("nan"), dtype=dtype)
    rms_norm_write(x, w, EPS, ref, rows)
    assert torch.equal(ref.isnan(), want.isnan()) and torch.equal(ref[rows], want[rows])
    got = torch.full((11, 56), float("nan"), dtype=dtype)
    tri(x, w, EPS, got, rows)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[rows, 40:], want[rows, 40:])
    assert_close_to_torch(got[rows, :40], want[rows, :40], dtype)
    calls = []
    monkeypatch.setattr(rms_op, "triton_op", lambda name, t: (lambda *a: calls.append(name) or tri(*a)))
    rms_norm_write(x, w, EPS, got, rows)
    assert calls == ["rms_norm_write"]
    with pytest.raises(ValueError, match="rms_norm_write"):
        rms_norm_write(x, w, EPS, got[:, :50], rows)
