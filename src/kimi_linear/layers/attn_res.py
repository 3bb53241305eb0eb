"""Block Attention Residuals (Kimi K3; "Attention Residuals", arXiv 2603.15031), docs/model.md §7.

Instead of ``x + f(x)``, the input of every sublayer is a softmax-weighted mix over depth of a list of *sources*
[S, B, T, D]: the token embedding, the summaries of the completed blocks and the current block's partial sum.

Choices (from the paper's block pseudocode and the released K3 files, documented here and in docs/model.md §7):
- ``attn_res_block_size`` counts *decoder layers* (K3 release: 12, so on 93 layers the block list is snapshotted
  at layers 0, 12, ..., 84). At the first layer of a block, the running partial sum (at layer 0: the embedding)
  is appended to the block list and a new partial sum starts. So the sources are
  ``[embedding, block_1, ..., block_{n-1}, partial]`` where ``block_j`` is the sum of the sublayer outputs of
  block j and ``partial`` the sum of the current block's sublayer outputs so far (or, for the attention
  sublayer of a block's first layer, the block just completed).
- Score of source ``v``: ``proj . RMSNorm(v)`` (``{attn,mlp}_res_proj.weight`` [1, D] is the learned pseudo-query,
  ``{attn,mlp}_res_norm.weight`` the RMSNorm weight); softmax over sources; the mix uses the *raw* sources; all in
  float32, cast back to the model dtype. Zero-initialised queries give a uniform mix.
- The mix is per token (no mixing across positions), so it needs no cache: decoding with a cache equals the full
  forward as long as the sublayers themselves do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .norm import upcast


def depth_mix(sources: list[torch.Tensor], proj: nn.Linear, norm: nn.Module) -> torch.Tensor:
    """sources: S tensors [B, T, D] -> [B, T, D]: ``sum_s softmax_s(proj . RMSNorm(v_s)) * v_s``, float32 inside.

    ``norm`` is an :class:`~kimi_linear.layers.RMSNorm` (its ``weight`` and ``eps`` are read directly, so the
    normalisation is float32 end to end).
    """
    if len(sources) == 1:
        return sources[0]  # softmax over one source is exactly 1
    V = upcast(torch.stack(sources))                                                     # [S, B, T, D]
    K = F.rms_norm(V, (V.shape[-1],), upcast(norm.weight), eps=norm.eps)
    logits = K @ upcast(proj.weight)[0]                                                  # [S, B, T]
    w = logits.softmax(0)
    return torch.einsum("sbt,sbtd->btd", w, V).to(sources[0].dtype)


class AttnResState:
    """The depth bookkeeping of one forward pass: completed block summaries and the current partial sum.

    Between decoder layers it travels as plain tensors (``blocks`` list, ``partial``), so that module hooks which
    look for tensors in a layer's inputs and outputs (FSDP2's unshard-for-backward) see them."""

    def __init__(self, partial: torch.Tensor, blocks: list[torch.Tensor] | None = None) -> None:
        self.blocks: list[torch.Tensor] = list(blocks or [])
        self.partial: torch.Tensor | None = partial

    def sources(self) -> list[torch.Tensor]:
        assert self.partial is not None
        return [*self.blocks, self.partial]

    def start_block(self) -> None:
        """Snapshot the partial sum into the block list; the next sublayer output starts a new partial sum."""
        assert self.partial is not None
        self.blocks.append(self.partial)
        self.partial = None

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out
