"""attention_lse (fused CPU kernel and the tiled PyTorch path) against explicit float64 softmax attention, and
merge_attention: blocks of keys merged through their log-sum-exps equal attention over all of them."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.ops import attention as att


def reference(q, k, v, scale, causal=False, past=0):
    """float64 softmax attention; causal: query t sees keys <= past + t (bottom-right aligned)."""
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        T, S = s.shape[-2:]
        s = s.masked_fill(torch.arange(S)[None] > torch.arange(T)[:, None] + past, float("-inf"))
    return s.softmax(-1) @ v.double(), torch.logsumexp(s, -1)


def inputs(T=9, S=9, d=16, dv=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    return r(2, 3, T, d), r(2, 3, S, d), r(2, 3, S, dv)


@pytest.mark.parametrize("path", ["fused", "torch"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(path, causal, dtype, monkeypatch):
    q, k, v = inputs(T=9, S=9 if causal else 13, dtype=dtype)
    if path == "torch":
        monkeypatch.setattr(att, "SCORE_ELEMENTS", 2 * 3 * 13 * 2)      # tiles of 2 queries
        out, lse = att.attention_lse_torch(q, k, v, 0.3, causal)
    else:
        out, lse = att.attention_lse(q, k, v, 0.3, causal)
    want, want_lse = reference(q, k, v, 0.3, causal)
    assert out.shape == (2, 3, 9, 12) and out.dtype == dtype and lse.shape == (2, 3, 9)
    bar = 1e-12 if dtype == torch.float64 else 1e-5
    assert (out.double() - want).abs().max() < bar and (lse.double() - want_lse).abs().max() < bar


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA flash / memory-efficient kernels need a GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, dv, bar", [(torch.bfloat16, 128, 2.0**-7), (torch.bfloat16, 192, 2.0**-7),
                                            (torch.float32, 128, 1e-5)])
def test_cuda_kernels_match_reference(causal, dtype, dv, bar):
    """The CUDA paths (flash for 16-bit with dv <= d: v padded; memory-efficient for float32) and their
    log-sum-exp convention, at MLA's widths (d = 192, dv = 128), against float64 (CPU CI cannot run this)."""
    q, k, v = (t.cuda() for t in inputs(T=67, S=67 if causal else 131, d=192, dv=dv, dtype=dtype, seed=4))
    kernel = att.attention_kernel(q, dv)
    out, lse = att.attention_lse(q, k, v, 192**-0.5, causal)
    want, want_lse = reference(q.cpu(), k.cpu(), v.cpu(), 192**-0.5, causal)
    assert kernel in ("flash", "efficient") and att.attention_kernel(q, dv) == kernel     # no fallback happened
    assert (out.cpu().double() - want).abs().max() < bar * want.abs().max()
    assert (lse.cpu().double() - want_lse).abs().max() < 1e-3


def test_kernel_choice():
    q = torch.zeros(1, 1, 2, 16)
    assert att.attention_kernel(q, 12) == "cpu-flash"
    assert att.attention_kernel(q.double()) == "torch"
    assert att.attention_kernel(q, 32) == "torch"              # values wider than keys: no padding trick


def test_blocks_merged_equal_attention_over_all_keys():
    """A chunk of T queries after P cached keys: P split in 3 blocks (no mask) + the chunk's own keys (square causal
    mask), merged = bottom-right causal attention over all P + T keys."""
    T, P = 5, 11
    q, k, v = inputs(T=T, S=P + T, dtype=torch.float32, seed=1)
    acc = None
    for a, b in ((0, 4), (4, 8), (8, P)):
        acc = att.merge_attention(acc, *att.attention_lse(q, k[:, :, a:b], v[:, :, a:b], 0.25))
    out, lse = att.merge_attention(acc, *att.attention_lse(q, k[:, :, P:], v[:, :, P:], 0.25, causal=True))
    want, want_lse = reference(q, k, v, 0.25, causal=True, past=P)
    assert (out.double() - want).abs().max() < 1e-5 and (lse.double() - want_lse).abs().max() < 1e-5


def test_errors_name_the_argument():
    q, k, v = inputs()
    with pytest.raises(ValueError, match="`k`"):
        att.attention_lse(q, k[..., :8], v, 1.0)
    with pytest.raises(ValueError, match="`v`"):
        att.attention_lse(q, k, v[:, :, :3], 1.0)
    with pytest.raises(ValueError, match="`causal`"):
        att.attention_lse(q[:, :, :4], k, v, 1.0, causal=True)
    with pytest.raises(ValueError, match="`q`"):
        att.attention_lse(q[0], k, v, 1.0)
