"""The hybrid decoding cache: fixed-size state per KDA layer, growing latent per MLA layer (docs/memory.md)."""

from __future__ import annotations

import torch

from kimi_linear.layers import KDAState, LatentCache


class HybridCache:
    """Per-layer caches for a batch of sequences decoded together.

    layers[i] is a :class:`KDAState` (conv window + float32 memory, constant size) for a KDA layer, or a
    :class:`LatentCache` (576-wide latent per token) for an MLA layer. ``key_mask`` [B, L] records which cached
    positions are real tokens (False at left padding) so MLA never attends to padding.
    """

    def __init__(self, layers: list[KDAState | LatentCache]) -> None:
        self.layers = layers
        self.seq_len = 0
        self.key_mask: torch.Tensor | None = None  # None while no position has ever been padding

    def append_mask(self, mask: torch.Tensor | None, batch_size: int, T: int, device: torch.device) -> None:
        """Record the padding mask [B, T] of the tokens being added (None = all real)."""
        if mask is not None and bool(mask.all()):
            mask = None
        if mask is not None or self.key_mask is not None:
            old = self.key_mask if self.key_mask is not None else torch.ones(
                batch_size, self.seq_len, dtype=torch.bool, device=device)
            new = mask.bool() if mask is not None else torch.ones(batch_size, T, dtype=torch.bool, device=device)
            self.key_mask = torch.cat([old, new], dim=1)
        self.seq_len += T

    def kda_bytes(self) -> int:
        """Bytes held by all KDA layers (independent of the context length)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, KDAState))

    def mla_bytes(self) -> int:
        """Bytes of cached MLA latents (grows by 576 entries per MLA layer per token)."""
        return sum(c.nbytes() for c in self.layers if isinstance(c, LatentCache))

    def nbytes(self) -> int:
        return self.kda_bytes() + self.mla_bytes()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows``."""
        for c in self.layers:
            c.select(rows)
        if self.key_mask is not None:
            self.key_mask = self.key_mask[rows]
