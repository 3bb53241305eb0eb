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

    def __init__(self, linears: list[nn.Linear], into: torch.Tensor | None = None) -> None:
        """into: a [sum(out), in] tensor of the weights' dtype and device to pack into (e.g. one expert's slice of
        a stack of experts, ``layers.moe.SparseMoE.pack``); by default a new matrix, its longer dimension
        contiguous."""
        ws = [lin.weight for lin in linears]
        if any(lin.bias is not None for lin in linears) or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1:
            raise ValueError("only bias-free linears with one dtype, device and input width can be packed")
        rows = sum(w.shape[0] for w in ws)
        if into is not None and (tuple(into.shape) != (rows, ws[0].shape[1]) or into.dtype != ws[0].dtype
                                 or into.device != ws[0].device):
            raise ValueError(f"`into` must be a {ws[0].dtype} tensor [{rows}, {ws[0].shape[1]}] on {ws[0].device}, "
                             f"got {into.dtype} {tuple(into.shape)} on {into.device}")
        with torch.no_grad():
            if into is not None:
                packed = into
                offset = 0
                for w in ws:
                    packed[offset : offset + w.shape[0]].copy_(w)
                    offset += w.shape[0]
            else:
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
        # The linears' parameter dicts, read directly: these checks run on every decode call, and going through
        # nn.Module.__getattr__ for each weight costs more than the check itself.
        self._params = [lin._parameters for lin in linears]
        self._ptrs = self._current_ptrs()

    def _current_ptrs(self) -> tuple[int, ...]:
        return tuple(p["weight"].data_ptr() for p in self._params)

    def intact(self) -> bool:
        """True while every weight is still its view of the packed matrix."""
        return self._current_ptrs() == self._ptrs and self._params[0]["weight"].dtype == self.weight.dtype

    def valid(self) -> bool:
        """True while every weight is still a view of the packed matrix and no gradient is needed."""
        if torch.is_grad_enabled() and any(p["weight"].requires_grad for p in self._params):
            return False  # autograd must see the parameters themselves
        return self.intact()

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.valid():
            return list(linear(x, self.weight).split(self.sizes, dim=-1))
        return [lin(x) for lin in self.linears]
