"""A corpus every machine has offline: the Python standard library's source files, a BPE tokenizer trained on
it, and a deterministic source of packed training rows with document boundaries (``cu_seqlens``)."""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .chunks import cut_pieces
from .tasks import IGNORE


def stdlib_files() -> list[Path]:
    """Every ``.py`` file of this interpreter's standard library (site-packages excluded), sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def split_files(files: Sequence[Path], eval_every: int = 20) -> tuple[list[Path], list[Path]]:
    """(train, held-out): a file is held out when the CRC of its name falls in 1/``eval_every`` of the range, so the
    split does not depend on which other files exist."""
    held = [f for f in files if zlib.crc32(f.name.encode()) % eval_every == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def read_texts(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_bpe_tokenizer(texts: Sequence[str], vocab_size: int = 4096):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (ids of the special tokens first:
    ``<|endoftext|>`` 0, ``<|bos|>`` 1, ``<|pad|>`` 2), left padding for batched generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kimi_linear.model.tokenizer import BOS, EOS, PAD

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=BOS, pad_token=PAD,
                                   padding_side="left")


def encode_documents(tokenizer, texts: Sequence[str]) -> list[torch.Tensor]:
    """Each text -> int64 ids followed by the end-of-text id."""
    eos = tokenizer.eos_token_id
    return [torch.tensor(ids + [eos], dtype=torch.int64)
            for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def pack_row(docs: Sequence[torch.Tensor], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Concatenate ``docs`` (cut to fill exactly ``seq_len``) -> (input_ids [T], labels [T], document lengths).

    ``labels[t] = ids[t+1]`` inside a document and IGNORE on its last token, so nothing is predicted across a
    boundary (and, with ``cu_seqlens``, nothing is attended or remembered across one either)."""
    ids, labels, lengths = [], [], []
    room = seq_len
    for d in docs:
        if room == 0:
            break
        d = d[:room]
        ids.append(d)
        labels.append(torch.cat([d[1:], torch.tensor([IGNORE])]))
        lengths.append(len(d))
        room -= len(d)
    if room:
        raise ValueError(f"documents hold {seq_len - room} tokens, fewer than seq_len={seq_len}")
    return torch.cat(ids), torch.cat(labels), lengths


class PackedTextSource:
    """Rows of ``seq_len`` tokens packed from documents; a batch of B rows becomes one packed row [1, B*T] with
    ``cu_seqlens`` at every document and row boundary. Batch ``(step, micro)`` is a pure function of the seed.

    Training documents are first cut into pieces of at most ``seq_len`` tokens (each piece is its own sequence for
    ``cu_seqlens``). Each training row starts at a piece chosen by a seeded permutation per epoch and takes the
    following pieces until full, so an epoch covers every token of the corpus. (Rows that started at whole
    documents only ever saw each file's first ``seq_len`` tokens, which a small model memorises within a few
    epochs.)"""

    def __init__(self, train_docs: list[torch.Tensor], eval_docs: list[torch.Tensor], batch_size: int,
                 seq_len: int, seed: int = 0, grad_accum: int = 1, eval_rows: int = 32):
        if not train_docs or not eval_docs:
            raise ValueError("`train_docs` and `eval_docs` must both hold documents")
        for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("grad_accum", grad_accum)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}")
        self.train_docs, self.eval_docs = train_docs, eval_docs
        self.train_pieces = [train_docs[d][s:s + seq_len] for d, s in cut_pieces(train_docs, seq_len)]
        self.batch_size, self.seq_len, self.seed, self.grad_accum = batch_size, seq_len, seed, grad_accum
        self.eval_rows = eval_rows
        self.rank, self.world = 0, 1

    def shard(self, rank: int, world: int) -> PackedTextSource:
        """Keep training rows ``rank::world`` of every batch (data parallel); evaluation stays whole."""
        if self.batch_size % world:
            raise ValueError(f"batch size {self.batch_size} is not divisible by the world size {world}")
        self.rank, self.world = rank, world
        return self

    def _row(self, docs: list[torch.Tensor], start: int):
        picked, total, i = [], 0, start
        while total < self.seq_len:
            d = docs[i % len(docs)]
            picked.append(d)
            total += len(d)
            i += 1
        return pack_row(picked, self.seq_len)

    def _rows_to_batch(self, rows) -> dict[str, torch.Tensor]:
        ids = torch.cat([r[0] for r in rows])[None]
        labels = torch.cat([r[1] for r in rows])[None]
        lengths = [n for r in rows for n in r[2]]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        return {"input_ids": ids, "labels": labels, "cu_seqlens": cu}

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        n = len(self.train_pieces)
        first = (step * self.grad_accum + micro) * self.batch_size
        rows = []
        for r in range(first + self.rank, first + self.batch_size, self.world):
            epoch, pos = divmod(r, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
            rows.append(self._row(self.train_pieces, int(perm[pos])))
        return self._rows_to_batch(rows)

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Held-out rows, packed consecutively from the start of the held-out documents."""
        rows, start = [], 0
        for _ in range(self.eval_rows):
            row = self._row(self.eval_docs, start)
            rows.append(row)
            start += len(row[2])
        for i in range(0, len(rows), self.batch_size):
            yield self._rows_to_batch(rows[i:i + self.batch_size])
