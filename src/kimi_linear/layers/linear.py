"""Linear maps with a faster CPU path for one row at a time (decoding).

A decode step multiplies one hidden vector by every weight of the model, and those weights (~100 MB for the
`small` preset) do not stay in cache between steps. CPU BLAS runs such a matrix-vector product on one core, which
streams a cold weight at ~8 GB/s on the development box, whereas both cores together read memory at ~20 GB/s. Split
the output features into one block per intra-op thread and run the blocks as one batched product (``bmm``
parallelises over the batch): every core streams its share of the weight, 1.3-1.8x faster per projection
(BENCHMARKS.md, "The model on a CPU"). Same arithmetic per output (one dot product over the input features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _row_blocks(weight: torch.Tensor, n: int) -> torch.Tensor | None:
    """weight [out, in] as n blocks of output features, [n, in, out/n], without copying (one ``as_strided``);
    None if its layout does not allow that."""
    out_f, in_f = weight.shape
    if out_f % n:
        return None
    rows = out_f // n
    stride = weight.stride()
    if stride == (in_f, 1):                                   # row-major: each block is a contiguous slab
        return weight.as_strided((n, in_f, rows), (rows * in_f, 1, in_f))
    if stride == (1, out_f):                                  # column-major: each block is a column range
        return weight.as_strided((n, in_f, rows), (rows, out_f, 1))
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; x [..., in] holding a single row on the CPU without autograd goes through a
    thread-parallel batched product (see the module docstring)."""
    n = torch.get_num_threads()
    in_f = x.shape[-1]
    if (
        n > 1 and x.numel() == in_f and x.device.type == "cpu" and x.dtype == weight.dtype
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    ):
        blocks = _row_blocks(weight, n)
        if blocks is not None:
            # x broadcast to every block without a copy: [n, 1, in] with batch stride 0.
            y = torch.bmm(x.contiguous().as_strided((n, 1, in_f), (0, in_f, 1)), blocks)     # [n, 1, out/n]
            y = y.view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names and initialisation) whose forward uses :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
