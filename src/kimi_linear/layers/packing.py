"""Packing several ``nn.Linear`` weights that read the same input into one matrix, without copying them.

Decoding is a chain of matrix-vector products bound by memory bandwidth and per-call overhead; one product over a
packed [sum(out), in] matrix is faster than several small ones. The individual weights become *views* into the
packed storage, so parameter names, shapes, ``state_dict()`` and in-place updates are unchanged and no memory is
duplicated. If a weight is later replaced (``load_state_dict(assign=True)``, ``.to(dtype)``), :meth:`valid` notices
and callers fall back to the separate projections.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import linear


class PackedLinears:
    """Views ``linears`` as one linear map; ``__call__`` returns the concatenated outputs [..., sum(out)]."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        ws = [lin.weight for lin in linears]
        if any(lin.bias is not None for lin in linears) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
            raise ValueError("only bias-free linears with one dtype, device and input width can be packed")
        with torch.no_grad():
            packed = torch.cat([w.detach() for w in ws], 0)
            if packed.shape[0] > packed.shape[1]:
                packed = packed.t().contiguous().t()  # longer dimension contiguous: faster CPU gemv
            offset = 0
            for lin in linears:
                n = lin.weight.shape[0]
                lin.weight.data = packed[offset : offset + n]
                offset += n
        self.linears = linears
        self.weight = packed
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> tuple[int, ...]:
        return tuple(lin.weight.data_ptr() for lin in self.linears)

    def valid(self) -> bool:
        """True while every weight is still a view of the packed matrix and no gradient is needed."""
        if torch.is_grad_enabled() and any(lin.weight.requires_grad for lin in self.linears):
            return False  # autograd must see the parameters themselves
        return self._current_ptrs() == self._ptrs and self.linears[0].weight.dtype == self.weight.dtype

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.valid():
            return list(linear(x, self.weight).split(self.sizes, dim=-1))
        return [lin(x) for lin in self.linears]
