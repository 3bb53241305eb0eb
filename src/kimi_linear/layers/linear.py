"""Linear maps with a faster CPU path for one row at a time (decoding).

A decode step multiplies one hidden vector by every weight of the model, and those weights (~100 MB for the
`small` preset) do not stay in cache between steps. CPU BLAS runs such a matrix-vector product on one core, which
streams a cold weight at ~8 GB/s on the development box, whereas both cores together read memory at ~20 GB/s. Split
the output features into one block per intra-op thread and run the blocks as one batched product (``bmm``
parallelises over the batch): every core streams its share of the weight, 1.3-1.8x faster per projection
(see BENCHMARKS.md, issue 3). Same arithmetic per output (one dot product over the input features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _row_blocks(weight: torch.Tensor, n: int) -> torch.Tensor | None:
    """weight [out, in] as n blocks of output features, [n, in, out/n], without copying; None if its layout
    does not allow that."""
    out_f, in_f = weight.shape
    if out_f % n:
        return None
    if weight.stride() == (in_f, 1):                          # row-major: each block is a contiguous slab
        return weight.view(n, out_f // n, in_f).transpose(1, 2)
    if weight.stride() == (1, out_f):                         # column-major: each block is a column range
        return weight.t().view(in_f, n, out_f // n).transpose(0, 1)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; x [..., in] holding a single row on the CPU without autograd goes through a
    thread-parallel batched product (see the module docstring)."""
    n = torch.get_num_threads()
    if (
        n > 1 and x.device.type == "cpu" and x.numel() == x.shape[-1]
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        blocks = _row_blocks(weight, n)
        if blocks is not None and blocks.dtype == x.dtype:
            in_f = weight.shape[1]
            y = torch.bmm(x.reshape(1, 1, in_f).expand(n, 1, in_f), blocks).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and initialisation) whose forward uses :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
