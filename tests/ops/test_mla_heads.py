"""The per-head products around an MLA decode step (ops.mla_heads): the PyTorch paths against the definition
written out per row and head in float64, the Triton kernel (under the interpreter) against them on weights that
are views of a kv_b_proj weight (strided, as the layer passes them), batches that are not multiples of the
kernel's row block, reduction lengths that are not multiples of its step."""

import pytest
import torch

from kimi_linear.ops.mla_heads import absorb_query, absorb_query_torch, expand_values, expand_values_torch

H, NOPE, V, C, R = 3, 80, 24, 72, 8


def weights(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(H * (NOPE + V), C, generator=gen) / C**0.5).to(dtype).view(H, NOPE + V, C)
    return w[:, :NOPE], w[:, NOPE:]                                   # [H, nope, C], [H, v, C]: strided views


def test_torch_paths_are_the_definition():
    w_k, w_v = weights(torch.float64)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, H, NOPE + R, generator=gen, dtype=torch.float64)
    ctx = torch.randn(2, H, C, generator=gen, dtype=torch.float64)
    a, e = absorb_query_torch(q, w_k), expand_values_torch(ctx, w_v)
    for b in range(2):
        for h in range(H):
            assert torch.allclose(a[b, h, :C], q[b, h, :NOPE] @ w_k[h]) and torch.equal(a[b, h, C:], q[b, h, NOPE:])
            assert torch.allclose(e[b, h], w_v[h] @ ctx[b, h])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2.0**-7)])
@pytest.mark.parametrize("B", [1, 5, 17])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_triton_matches_torch(dtype, tol, B, wide, monkeypatch):
    pytest.importorskip("triton")
    import kimi_linear.ops.triton.mla_heads as tri

    if wide:        # a large batch's widest tiles (past N here: masked columns) on these small shapes
        monkeypatch.setattr(tri, "TARGET_PROGRAMS", 1)
        assert tri.columns(B, H, C, 64) == 128 and tri.columns(B, H, V, 16) == 32
    w_k, w_v = weights(dtype)
    gen = torch.Generator().manual_seed(B)
    q = torch.randn(B, H, NOPE + R, generator=gen).to(dtype)
    ctx = torch.randn(B, H, C, generator=gen).to(dtype)
    for got, want in ((tri.absorb_query(q, w_k), absorb_query_torch(q.double(), w_k.double())),
                      (tri.expand_values(ctx, w_v), expand_values_torch(ctx.double(), w_v.double()))):
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
    assert torch.equal(tri.absorb_query(q, w_k)[..., C:], q[..., NOPE:])     # the rope part is copied, not computed
    q_view = torch.randn(B, 2, H, NOPE + R, generator=gen).to(dtype)[:, 1]  # a query with a batch stride
    assert torch.equal(tri.absorb_query(q_view, w_k), tri.absorb_query(q_view.contiguous(), w_k))


def test_columns_widen_with_the_batch():
    """48B shapes (32 heads, C = 512, v = 128): the narrow tiles at small batches, wider ones once the row blocks
    alone fill the launch, never past WIDEST."""
    pytest.importorskip("triton")
    from kimi_linear.ops.triton.mla_heads import TARGET_PROGRAMS, WIDEST, columns

    assert [columns(B, 32, 512, 64) for B in (1, 16, 17, 64, 256)] == [64, 64, 128, 128, 128]
    assert [columns(B, 32, 128, 16) for B in (1, 16, 17, 64, 256)] == [16, 16, 32, 64, 128]
    for B in (1, 17, 100, 256, 4096):
        for N, narrowest in ((512, 64), (128, 16)):
            BN = columns(B, 32, N, narrowest)
            assert narrowest <= BN <= WIDEST
            assert BN == narrowest or 32 * -(-N // BN) * -(-B // 16) >= TARGET_PROGRAMS


def test_public_ops_dispatch_and_name_bad_arguments(monkeypatch):
    import kimi_linear.ops.mla_heads as op
    import kimi_linear.ops.triton.mla_heads as tri

    calls = []
    monkeypatch.setattr(op, "triton_op", lambda name, x: (lambda *a: calls.append(name) or getattr(tri, name)(*a)))
    w_k, w_v = weights(torch.float32)
    q, ctx = torch.randn(2, H, NOPE + R), torch.randn(2, H, C)
    assert torch.allclose(absorb_query(q, w_k), absorb_query_torch(q, w_k), atol=1e-5)
    assert torch.allclose(expand_values(ctx, w_v), expand_values_torch(ctx, w_v), atol=1e-5)
    assert calls == ["absorb_query", "expand_values"]
    absorb_query(q.requires_grad_(), w_k)                  # a gradient to track: the PyTorch path
    assert calls == ["absorb_query", "expand_values"]
    big = torch.randn(op.EXPAND_KERNEL_ROWS + 1, H, C)     # past the rows where the kernel beats cuBLAS
    assert torch.equal(expand_values(big, w_v), expand_values_torch(big, w_v))
    assert calls == ["absorb_query", "expand_values"]
    expand_values(big[: op.EXPAND_KERNEL_ROWS], w_v)
    assert calls == ["absorb_query", "expand_values", "expand_values"]
    with pytest.raises(ValueError, match="absorb_query"):
        absorb_query(q[..., : NOPE - 1], w_k)
    with pytest.raises(ValueError, match="absorb_query"):
        absorb_query(q.detach().double(), w_k)
    with pytest.raises(ValueError, match="expand_values"):
        expand_values(ctx[..., :-1], w_v)
    with pytest.raises(ValueError, match="expand_values"):
        expand_values(ctx[:, :2], w_v)


BUILD_SM90 = """
from kimi_linear.ops.triton.mla_heads import BB, BK, head_products_kernel

sig = dict(x="*bf16", w="*bf16", out="*bf16", B="i32", H="i32", K="i32", N="i32", s_xb="i64", s_xh="i64",
           s_wh="i64", s_wk="i64", s_wn="i64")
for R, BN in ((64, 64), (0, 16), (64, 128), (0, 128)):   # absorb_query's (the rope copy), expand_values'; wide
    ck = compile(head_products_kernel, sig, dict(W_OUT=512 + R, R=R, BB=BB, BN=BN, BK=BK, BR=64, PREC="tf32",
                                                 PDL=True))
    assert len(ck.asm["cubin"]) > 0
print("BUILT")
"""


def test_kernel_builds_for_sm90(tmp_path):
    """The interpreter runs what the GPU compiler refuses (a plain global in a kernel, say): build the kernel for
    sm_90 as the two ops launch it."""
    from .sm90 import build_sm90

    build_sm90(BUILD_SM90, tmp_path)
