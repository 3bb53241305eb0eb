"""A decode step's last work: its logits in float32 and every row's greedy token.

    logits32 = float32(logits)                               [B, V]
    ids[r]   = the first j with logits32[r, j] = max_j logits32[r, j]      (torch.argmax's choice on ties)
    ids[r]   = -1 where row r holds a NaN

In PyTorch that is five kernels a step (the cast, ``isnan``, ``any``, ``argmax``, ``where``): 30 us of the 48B-shaped
model's batch-1 step on the H200 (a one-row argmax over 163,840 logits alone took 9 us), where the step's other
tail, the LM head, streams 755 MB in 168 us. On CUDA two Triton kernels do it (:mod:`kimi_linear.ops.triton.greedy`):
one pass over chunks of every row (cast, store, each chunk's maximum with its first index and a NaN flag), then one
program a row over its chunks' maxima.
"""

from __future__ import annotations

import torch

from .backend import triton_op


def logits_and_greedy_torch(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logits_and_greedy` in PyTorch (float32 logits are returned as they are, not copied)."""
    x = logits.float()
    return x, torch.where(x.isnan().any(-1), -1, x.argmax(-1))


def logits_and_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] of any floating dtype -> (float32 logits [B, V], int64 ids [B] of those) as in the module
    docstring. No host sync: a CUDA-graph step can end with it."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.shape[1] == 0:
        raise ValueError(f"logits_and_greedy: logits must be a floating-point [B, V] tensor with V >= 1, got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    fast = triton_op("logits_and_greedy", logits)
    if fast is None or logits.shape[0] == 0 or logits.dtype == torch.float64:
        return logits_and_greedy_torch(logits)
    return fast(logits)
