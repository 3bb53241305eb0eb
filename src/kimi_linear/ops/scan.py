"""The only sequential step of the chunkwise algorithm: the state carried from chunk to chunk.

With per-chunk ``W, U`` (WY form), ``k_end = k * exp(G_C - G)`` and ``decay = exp(G_C)``:

    Delta_n   = U_n - W_n S_n
    S_{n+1}   = Diag(decay_n) S_n + k_end_n^T Delta_n

Autograd through this loop records a few tiny ops per chunk; this Function instead runs the reverse loop by hand.
Both loops are chunk-major ([NC, batch, ...], contiguous per chunk) and use fused ``baddbmm`` so each chunk costs
three kernel calls; everything that is not sequential runs as one batched matmul over all chunks.
"""

from __future__ import annotations

import torch


def _chunk_major(x: torch.Tensor) -> torch.Tensor:
    """[..., NC, A, B] -> [NC, prod(...), A, B], contiguous."""
    return x.movedim(-3, 0).reshape(x.shape[-3], -1, *x.shape[-2:]).contiguous()


def _back(x: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """Inverse of :func:`_chunk_major`."""
    return x.reshape(x.shape[0], *lead, *x.shape[-2:]).movedim(0, -3)


class ChunkStateScan(torch.autograd.Function):
    """(W, U, k_end [.., NC, C, K|V], decay [.., NC, K], S0 [.., K, V]) -> (S_starts [.., NC, K, V],
    Delta [.., NC, C, V], S_final [.., K, V])."""

    @staticmethod
    def forward(ctx, W, U, k_end, decay, S0):
        lead = S0.shape[:-2]
        W_, U_, kT_ = _chunk_major(W), _chunk_major(U), _chunk_major(k_end.transpose(-1, -2))
        d_ = _chunk_major(decay.unsqueeze(-1))                                  # [NC, b, K, 1]
        NC = W_.shape[0]
        S = S0.reshape(-1, *S0.shape[-2:]).contiguous()
        S_starts = S.new_empty(NC, *S.shape)
        Delta = U_.new_empty(U_.shape)
        for n in range(NC):
            S_starts[n] = S
            torch.baddbmm(U_[n], W_[n], S, alpha=-1, out=Delta[n])             # U - W S
            S = torch.baddbmm(S * d_[n], kT_[n], Delta[n])                     # decay S + k_end^T Delta
        ctx.save_for_backward(W_, kT_, d_, S_starts, Delta)
        ctx.lead = lead
        return _back(S_starts, lead), _back(Delta, lead), S.reshape(S0.shape)

    @staticmethod
    def backward(ctx, dS_starts, dDelta, dS_final):
        W_, kT_, d_, S_starts, Delta = ctx.saved_tensors
        lead = ctx.lead
        NC = W_.shape[0]
        dS_starts_ = None if dS_starts is None else _chunk_major(dS_starts)
        gD = torch.zeros_like(Delta) if dDelta is None else _chunk_major(dDelta)   # becomes the total dDelta
        dS = torch.zeros_like(S_starts[0]) if dS_final is None else dS_final.reshape(S_starts.shape[1:]).clone()
        dS_next = torch.empty_like(S_starts)
        for n in reversed(range(NC)):
            dS_next[n] = dS                                                     # gradient reaching S_{n+1}
            gD[n].baddbmm_(kT_[n].transpose(-1, -2), dS)                       # + k_end dS
            dS = torch.baddbmm(dS * d_[n], W_[n].transpose(-1, -2), gD[n], alpha=-1)
            if dS_starts_ is not None:
                dS += dS_starts_[n]
        dW = -(gD @ S_starts.transpose(-1, -2))
        dk_end = Delta @ dS_next.transpose(-1, -2)
        ddecay = (S_starts * dS_next).sum(-1)
        return (_back(dW, lead), _back(gD, lead), _back(dk_end, lead), _back(ddecay.unsqueeze(-1), lead).squeeze(-1),
                dS.reshape(*lead, *dS.shape[-2:]))
