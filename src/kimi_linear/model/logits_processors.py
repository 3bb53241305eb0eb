"""The per-step rules of ``generate`` beyond temperature / top-k / top-p, with transformers' semantics:
repetition penalty, a minimum number of new tokens before EOS, and stop strings.

They act on the logits ``generate``'s loop gets back from either decode path (the hybrid cache, or the fixed-shape
step replayed as a CUDA graph, whose sampling already happens outside the graph), so both paths honour them.
Nothing here writes into the logits it is given: the graph path's logits are a buffer the next replay overwrites.
"""

from __future__ import annotations

from typing import Any

import torch

from .generation_config import GenerateOptions


class TokenRules:
    """Built once per ``generate`` call from the prompt ``ids`` [B, T] (and its left-padding ``mask`` [B, T] or
    None); :meth:`process` then adjusts each step's logits [B, vocab], :meth:`stopped` says which rows just
    completed a stop string."""

    def __init__(self, opts: GenerateOptions, ids: torch.Tensor, mask: torch.Tensor | None, vocab_size: int,
                 tokenizer: Any = None) -> None:
        self.opts = opts
        self.steps = 0
        self.eos = torch.tensor(opts.eos_token_id, device=ids.device) if opts.eos_token_id else None
        self.seen: torch.Tensor | None = None
        if opts.repetition_penalty != 1.0:
            # seen [B, vocab]: tokens of the prompt (padding excluded, as transformers does) and of the output.
            # Padding positions scatter into an extra column that is then dropped.
            B = ids.shape[0]
            real = ids if mask is None else ids.masked_fill(mask == 0, vocab_size)
            seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=ids.device)
            self.seen = seen.scatter_(1, real.long(), True)[:, :vocab_size]
            self.rows = torch.arange(B, device=ids.device)
        self.stop = None
        if opts.stop_strings:
            from transformers import StopStringCriteria

            self.stop = StopStringCriteria(tokenizer=tokenizer, stop_strings=opts.stop_strings)

    @property
    def active(self) -> bool:
        """Whether :meth:`process` changes anything at all (else the loop skips it)."""
        return self.seen is not None or (self.eos is not None and self.opts.min_new_tokens > 0)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, vocab] of the next token -> adjusted float32 logits (a new tensor)."""
        logits = logits.float()
        if self.seen is not None:
            p = self.opts.repetition_penalty
            logits = torch.where(self.seen, torch.where(logits < 0, logits * p, logits / p), logits)
        if self.eos is not None and self.steps < self.opts.min_new_tokens:
            logits = logits.index_fill(-1, self.eos, float("-inf"))
        return logits

    def update(self, nxt: torch.Tensor) -> None:
        """Record the step's tokens nxt [B]."""
        self.steps += 1
        if self.seen is not None:
            self.seen[self.rows, nxt] = True

    def stopped(self, seq: torch.Tensor) -> torch.Tensor | None:
        """seq [B, L]: prompts and the tokens so far -> bool [B], rows whose text now ends in a stop string (the
        string overlapping the last token, as transformers' ``StopStringCriteria``); None without stop strings."""
        if self.stop is None:
            return None
        return self.stop(seq, None)
