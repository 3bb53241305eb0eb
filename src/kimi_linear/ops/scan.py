"""The only sequential step of the chunkwise algorithm: the state carried from chunk to chunk.

With per-chunk ``W, U`` (WY form), ``k_end = k * exp(G_C - G)`` and ``decay = exp(G_C)``:

    Delta_n   = U_n - W_n S_n
    S_{n+1}   = Diag(decay_n) S_n + k_end_n^T Delta_n

Autograd through this loop records a few tiny ops per chunk; this Function instead runs the reverse loop by hand
(two matmuls per chunk) and does everything that is not sequential as batched matmuls over all chunks at once.
"""

from __future__ import annotations

import torch


def scan_states(W, U, k_end, decay, S0):
    """Loop body shared by forward; returns (S_starts [.., NC, K, V], Delta [.., NC, C, V], S_final)."""
    NC = W.shape[-3]
    S = S0
    starts, deltas = [], []
    for n in range(NC):
        starts.append(S)
        D = U[..., n, :, :] - W[..., n, :, :] @ S
        deltas.append(D)
        S = decay[..., n, :, None] * S + k_end[..., n, :, :].transpose(-1, -2) @ D
    return torch.stack(starts, dim=-3), torch.stack(deltas, dim=-3), S


class ChunkStateScan(torch.autograd.Function):
    """(W, U, k_end, decay, S0) -> (S_starts, Delta, S_final); shapes [.., NC, C, K|V], [.., NC, K], [.., K, V]."""

    @staticmethod
    def forward(ctx, W, U, k_end, decay, S0):
        S_starts, Delta, S_final = scan_states(W, U, k_end, decay, S0)
        ctx.save_for_backward(W, k_end, decay, S_starts, Delta)
        return S_starts, Delta, S_final

    @staticmethod
    def backward(ctx, dS_starts, dDelta, dS_final):
        W, k_end, decay, S_starts, Delta = ctx.saved_tensors
        NC = W.shape[-3]
        dS_starts = torch.zeros_like(S_starts) if dS_starts is None else dS_starts
        dDelta = torch.zeros_like(Delta) if dDelta is None else dDelta
        dS = torch.zeros_like(S_starts[..., 0, :, :]) if dS_final is None else dS_final
        dS_next, dD_total = [], []
        for n in reversed(range(NC)):
            dS_next.append(dS)                                              # gradient reaching S_{n+1}
            gD = dDelta[..., n, :, :] + k_end[..., n, :, :] @ dS            # [.., C, V]
            dD_total.append(gD)
            dS = dS_starts[..., n, :, :] + decay[..., n, :, None] * dS - W[..., n, :, :].transpose(-1, -2) @ gD
        dS_next = torch.stack(dS_next[::-1], dim=-3)                        # [.., NC, K, V]
        gD = torch.stack(dD_total[::-1], dim=-3)                            # [.., NC, C, V]
        dW = -gD @ S_starts.transpose(-1, -2)
        dk_end = Delta @ dS_next.transpose(-1, -2)
        ddecay = (S_starts * dS_next).sum(-1)
        return dW, gD, dk_end, ddecay, dS
