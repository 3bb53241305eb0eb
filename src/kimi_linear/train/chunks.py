"""Language-model batches of whole-document pieces: [B, T] rows, right-padded, no ``cu_seqlens``.

Each document (ids ending with the end-of-text id) is cut into consecutive pieces of at most ``seq_len`` tokens;
a row holds one piece, padded on the right with ``pad_id`` (label IGNORE). Labels are the next token *in the
document*, so the last position of a piece predicts the first token of the next piece, and every token of a
document but its first is scored exactly once per epoch. Nothing crosses a document boundary, yet no packed mask
is needed: right padding is invisible to a causal model (attention, KDA's recurrence and the short convolution
only look back), so softmax attention keeps its plain causal kernel.

Compared with :class:`~kimi_linear.train.corpus.PackedTextSource` (pieces packed into one row with ``cu_seqlens``),
a piece's last token still predicts the next piece's first, and the cost of attention stays O(B T^2) instead of
O((B T)^2) for a packed row (where the attention backend has no varlen kernel). The price is padding: the last piece
of each document is partly empty (``fill`` says how full rows are).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .tasks import IGNORE


def cut_pieces(docs: Sequence[torch.Tensor], seq_len: int) -> list[tuple[int, int]]:
    """(document index, start) of every piece of at most ``seq_len`` tokens, in document order."""
    if seq_len < 1:
        raise ValueError(f"`seq_len` must be >= 1, got {seq_len}")
    return [(d, s) for d, doc in enumerate(docs) for s in range(0, len(doc), seq_len)]


class DocumentChunkSource:
    """Batches of ``batch_size`` document pieces (``input_ids``/``labels`` [B, seq_len]); batch ``(step, micro)`` is
    a pure function of the seed (a seeded permutation of the pieces per epoch). ``eval_batches`` walks the held-out
    pieces in order (the first ``eval_rows`` of them when > 0, else all). ``served_tokens`` counts the real (not
    padding) tokens handed out by :meth:`batch`."""

    def __init__(self, train_docs: list[torch.Tensor], eval_docs: list[torch.Tensor], batch_size: int, seq_len: int,
                 pad_id: int, seed: int = 0, grad_accum: int = 1, eval_rows: int = 0) -> None:
        if not train_docs or not eval_docs:
            raise ValueError("`train_docs` and `eval_docs` must both hold documents")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        self.train_docs, self.eval_docs = train_docs, eval_docs
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.seed, self.grad_accum = seed, grad_accum
        self.train_pieces = cut_pieces(train_docs, seq_len)
        pieces = cut_pieces(eval_docs, seq_len)
        self.eval_pieces = pieces[:eval_rows] if eval_rows > 0 else pieces
        self.served_tokens = 0
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def fill(self) -> float:
        """Real tokens over row capacity of the training pieces (1 - padding share)."""
        return sum(len(d) for d in self.train_docs) / (len(self.train_pieces) * self.seq_len)

    def _rows(self, docs: list[torch.Tensor], pieces: Sequence[tuple[int, int]]) -> tuple[dict, int]:
        T = self.seq_len
        ids = torch.full((len(pieces), T), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(pieces), T), IGNORE, dtype=torch.int64)
        real = 0
        for r, (d, s) in enumerate(pieces):
            doc = docs[d]
            piece = doc[s:s + T]
            ids[r, :len(piece)] = piece
            nxt = doc[s + 1:s + T + 1]
            labels[r, :len(nxt)] = nxt
            real += len(piece)
        return {"input_ids": ids, "labels": labels}, real

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = (epoch, torch.randperm(len(self.train_pieces), generator=gen))
        return self._perm[1]

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        n = len(self.train_pieces)
        first = (step * self.grad_accum + micro) * self.batch_size
        picked = []
        for r in range(first, first + self.batch_size):
            epoch, pos = divmod(r, n)
            picked.append(self.train_pieces[int(self._permutation(epoch)[pos])])
        out, real = self._rows(self.train_docs, picked)
        self.served_tokens += real
        return out

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(0, len(self.eval_pieces), self.batch_size):
            yield self._rows(self.eval_docs, self.eval_pieces[i:i + self.batch_size])[0]

    def eval_label_ids(self) -> list[list[int]]:
        """The scored (label) ids of each held-out row, for counting the bytes they stand for."""
        out = []
        for d, s in self.eval_pieces:
            out.append(self.eval_docs[d][s + 1:s + self.seq_len + 1].tolist())
        return out
