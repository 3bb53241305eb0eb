"""Moving tokens between the user's layout ([B, T, ...] or packed varlen) and per-sequence padded rows.

Both the chunk and the recurrent paths work on ``[N, L, ...]``: one row per sequence, padded at the end to a length
``L`` that is a multiple of the chunk size. Padding tokens are zeros (k = v = q = beta = g = 0), which leave the
state untouched, so the padded rows compute exactly what the unpadded sequences would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SequenceLayout:
    """Index maps for ``B`` rows of length ``T`` (``cu_seqlens`` None) or packed sequences (``cu_seqlens``).

    ``L`` is the longest sequence rounded up to ``multiple``.
    """

    def __init__(self, B: int, T: int, cu_seqlens: torch.Tensor | None, multiple: int, device: torch.device):
        self.B, self.T, self.multiple = B, T, multiple
        self.varlen = cu_seqlens is not None
        if not self.varlen:
            self.N = B
            self.lengths = [T] * B
            self.L = max(multiple, -(-T // multiple) * multiple)
            return
        bounds = cu_seqlens.tolist()
        self.lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
        self.N = len(self.lengths)
        self.L = max(multiple, -(-max(self.lengths) // multiple) * multiple)
        starts = torch.tensor(bounds[:-1], device=device, dtype=torch.int64)
        lengths = torch.tensor(self.lengths, device=device, dtype=torch.int64)
        pos = torch.arange(self.L, device=device, dtype=torch.int64)
        valid = pos[None, :] < lengths[:, None]                                   # [N, L]
        # Gather map into the packed tokens with one zero row appended at index T for padding.
        self.gather = torch.where(valid, starts[:, None] + pos[None, :], torch.full_like(valid, T, dtype=torch.int64))
        # Scatter map back: the padded-row position of every packed token, in packed order.
        self.scatter = (torch.arange(self.N, device=device)[:, None] * self.L + pos[None, :])[valid]

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, *rest] -> [N, L, *rest], zero padded."""
        if not self.varlen:
            pad = self.L - self.T
            if pad == 0:
                return x
            return F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad))
        flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
        return flat[self.gather]

    def from_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[N, L, *rest] -> [B, T, *rest], dropping the padding."""
        if not self.varlen:
            return y[:, : self.T]
        return y.reshape(self.N * self.L, *y.shape[2:])[self.scatter].unsqueeze(0)


def expand_heads(x: torch.Tensor, HV: int) -> torch.Tensor:
    """[B, T, H, X] -> [B, T, HV, X]: value head j reads q/k head j // (HV // H)."""
    H = x.shape[2]
    return x if H == HV else x.repeat_interleave(HV // H, dim=2)
