"""A prompt chunk after cached tokens (issue 21): NoPEMLA attends to the cached keys block by block, merged through
log-sum-exps, with no [T, past + T] mask; through a dense LatentCache and straight from a paged pool
(PagedPrefillView). Both must equal one causal forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.layers import NoPEMLA, PagedPrefillView
from kimi_linear.layers import mla as mla_mod
from kimi_linear.model.modeling import _mla_mask

from .test_layers import randomize, rel_err

B, N, P, D = 2, 23, 14, 48          # rows, tokens, cached before the chunk, hidden


def layer() -> NoPEMLA:
    return randomize(NoPEMLA(D, num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=6), seed=21).eval()


def small_key_blocks(monkeypatch, m: NoPEMLA, keys: int) -> None:
    """Key blocks of ``keys`` cached keys (float32): several blocks, not aligned with the pool's blocks."""
    per_key = B * m.num_heads * (2 * m.qk_dim + m.nope + m.v_dim) * 4
    monkeypatch.setattr(mla_mod, "KEY_BLOCK_BYTES", keys * per_key)


def test_no_mask_without_padding():
    assert _mla_mask(None, 1 << 20, 2048, torch.device("cpu")) is None
    assert _mla_mask(torch.ones(1, 5, dtype=torch.bool), 3, 2, torch.device("cpu")).shape == (1, 1, 2, 5)


def test_chunk_after_latent_cache_equals_one_forward(monkeypatch):
    m = layer()
    small_key_blocks(monkeypatch, m, 5)
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(x)                                                  # one causal forward, no cache
        cache = m.empty_cache(B, torch.float32, torch.device("cpu"))
        m(x[:, :P], cache)
        got = m(x[:, P:], cache)                                     # chunk after 14 cached tokens, no mask
    assert rel_err(got, want[:, P:]) < 1e-5


def test_chunk_through_paged_pool_equals_one_forward(monkeypatch):
    m = layer()
    small_key_blocks(monkeypatch, m, 5)
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(2))
    bs, nb = 4, 6
    pool = torch.full((B * nb + 3, bs, m.cache_width), float("nan"))    # blocks no row owns stay NaN
    table = torch.randperm(B * nb + 3, generator=torch.Generator().manual_seed(3))[: B * nb].view(B, nb)
    with torch.no_grad():
        want = m(x)
        first = m(x[:, :P], PagedPrefillView(pool, table.int(), 0))   # the first chunk: nothing cached yet
        got = m(x[:, P:], PagedPrefillView(pool, table, P))
        cache = m.empty_cache(B, torch.float32, torch.device("cpu"))
        m(x, cache)
    assert rel_err(first, want[:, :P]) < 1e-5 and rel_err(got, want[:, P:]) < 1e-5
    for b in range(B):                                               # every entry landed in its row's block
        entries = pool[table[b]].flatten(0, 1)[:N]
        assert torch.equal(entries, cache.buf[b, :N])


def test_training_through_a_cache_keeps_the_differentiable_mask_path():
    m = layer()
    x = torch.randn(B, N, D, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = m(x)
    cache = m.empty_cache(B, torch.float32, torch.device("cpu"))
    m(x[:, :P].detach(), cache)
    got = m(x[:, P:], cache)
    assert got.requires_grad and rel_err(got, want[:, P:]) < 1e-5
    got.sum().backward()
    assert m.q_proj.weight.grad is not None


def test_paged_prefill_view_refuses_gradients():
    m = layer()
    view = PagedPrefillView(torch.zeros(4, 4, m.cache_width), torch.zeros(1, 4, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="PagedPrefillView"):
        m(torch.randn(1, 3, D), view)


def test_consecutive_blocks_read_as_a_view(monkeypatch):
    """One row whose blocks are consecutive (a long prompt in a fresh pool): the history is read as a view of the
    pool, not gathered, with the same result; the engine's check of the block list."""
    from kimi_linear.engine.model_runner import consecutive_start

    m = layer()
    small_key_blocks(monkeypatch, m, 5)
    x = torch.randn(1, N, D, generator=torch.Generator().manual_seed(5))
    bs, nb = 4, 6
    pool = torch.full((nb + 5, bs, m.cache_width), float("nan"))
    table = torch.arange(3, 3 + nb)[None]                            # blocks 3, 4, .. 8
    with torch.no_grad():
        m(x[:, :P], PagedPrefillView(pool, table, 0))
        gathered = m(x[:, P:], PagedPrefillView(pool, table, P))
        view = PagedPrefillView(pool, table, P, first_block=3)
        viewed = m(x[:, P:], view)
    assert torch.equal(viewed, gathered)
    part = view.read(2, P - 1)
    assert part.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()        # no copy
    assert torch.equal(part, PagedPrefillView(pool, table, P).read(2, P - 1))
    assert consecutive_start([3, 4, 5, 9], 3) == 3 and consecutive_start([3, 4, 6], 3) is None
    assert consecutive_start([3], 2) is None and consecutive_start([], 0) is None
