"""NoPEMLA's one-token step through a PagedLatentView (entries written into a paged pool, attention read from it in
place) against the LatentCache path, with the PyTorch op and with the Triton kernels under the interpreter."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.layers import NoPEMLA, PagedLatentView
from kimi_linear.ops import mla_decode as md

from .test_layers import randomize, rel_err


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_paged_step_matches_latent_cache(backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        from kimi_linear.ops.triton import paged_mla_decode as tri

        monkeypatch.setattr(md, "triton_op", lambda name, x: tri)
    m = randomize(NoPEMLA(48, num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6, output_gate=True), seed=11).eval()
    x = torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(12))
    bs, nb, P = 4, 5, 10                                   # 2 rows x 5 blocks of a 12-block pool
    cache = m.empty_cache(2, torch.float32, torch.device("cpu"))
    pool = torch.full((P + 2, bs, m.cache_width), float("nan"))       # unused blocks and slots stay NaN
    perm = torch.randperm(P, generator=torch.Generator().manual_seed(13))
    table = perm.view(2, nb).int()                                     # shuffled, non-contiguous blocks
    with torch.no_grad():
        m(x[:, :10], cache)                                            # prefill: the dense path fills the cache
        for b in range(2):
            for j in range(10):
                pool[table[b, j // bs], j % bs] = cache.buf[b, j]
        for t in range(10, 16):                                        # decode: both paths, token by token
            want = m(x[:, t : t + 1], cache)
            lens = torch.full((2,), t + 1, dtype=torch.int32)
            dst = table[:, t // bs].long() * bs + t % bs
            view = PagedLatentView(pool, table, lens, dst, num_splits=2 if backend == "triton" else None)
            got = m(x[:, t : t + 1], view)
            assert rel_err(got, want) < 1e-5
            assert torch.equal(pool[table[:, t // bs].long(), t % bs], cache.buf[:, t])   # the entry was written


def test_paged_view_takes_one_token():
    m = NoPEMLA(16, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
    view = PagedLatentView(torch.zeros(2, 4, 12), torch.zeros(1, 2, dtype=torch.int32),
                           torch.ones(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="one token"):
        m(torch.randn(1, 2, 16), view)
