"""Prompt scoring: the log-probability of every prompt token given the tokens before it (what ``echo`` with
``logprobs`` returns and what evaluation harnesses sum), for several prompts in one forward.

Short prompts are packed into one row (``cu_seqlens``: nothing is attended or remembered across a prompt
boundary) and run through the model once. A prompt longer than ``chunk`` runs alone, ``chunk`` tokens at a time
through the hybrid cache, so memory stays bounded (the packed forward's MLA mask is [T, T]).

Log-softmax is taken in float32 over at most ``rows`` positions at a time, so a large vocabulary does not need a
[T, vocab] float32 tensor for the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .modeling import KimiLinearForCausalLM


@dataclass
class PromptScores:
    """One prompt of T tokens, scored.

    logprobs: [T - 1] float32, ``log p(ids[t + 1] | ids[: t + 1])`` (the first token has no score: nothing
        precedes it).
    top_ids, top_logprobs: [T - 1, k] the ``k`` most likely tokens at each of those positions and their
        log-probabilities (k = 0: empty).
    last_logits: [vocab] float32, the logits after the whole prompt (the next token's distribution, from which a
        completion's first token is sampled).
    """

    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    last_logits: torch.Tensor


def _gather(logits: torch.Tensor, targets: torch.Tensor, top: int, rows: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [N, vocab] (any float dtype), targets [N] -> (log p(target) [N], top ids [N, top], top logprobs
    [N, top]), all on the CPU, computed ``rows`` positions at a time in float32."""
    lps, tids, tlps = [], [], []
    for a in range(0, logits.shape[0], rows):
        lp = logits[a : a + rows].float().log_softmax(-1)
        lps.append(lp.gather(-1, targets[a : a + rows, None])[:, 0].cpu())
        if top > 0:
            v, i = lp.topk(top, dim=-1)
            tids.append(i.cpu())
            tlps.append(v.cpu())
    n = logits.shape[0]
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.empty(n, top if n == 0 else 0, dtype=dt)
    return (torch.cat(lps) if lps else torch.empty(0)), cat(tids, torch.int64), cat(tlps, torch.float32)


def _packed(model: KimiLinearForCausalLM, prompts: list[list[int]], top: int, rows: int) -> list[PromptScores]:
    """All prompts in one packed forward."""
    dev = model.device
    lens = [len(p) for p in prompts]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    logits = model(ids[None], cu_seqlens=torch.tensor(offsets, device=dev)).logits[0]        # [N, vocab]
    # Position t predicts token t + 1 of the same prompt; a prompt's last position predicts nothing in the row.
    nxt = torch.cat([ids[1:], ids[:1]])
    lp, tid, tlp = _gather(logits, nxt, top, rows)
    return [PromptScores(lp[a : b - 1], tid[a : b - 1], tlp[a : b - 1], logits[b - 1].float().cpu())
            for a, b in zip(offsets[:-1], offsets[1:])]


def _chunked(model: KimiLinearForCausalLM, prompt: list[int], top: int, chunk: int, rows: int) -> PromptScores:
    """One long prompt, ``chunk`` tokens per forward through the hybrid cache."""
    dev = model.device
    ids = torch.tensor(prompt, device=dev)
    cache = model.new_cache(1)
    lps, tids, tlps = [], [], []
    last = None
    for a in range(0, len(prompt), chunk):
        b = min(a + chunk, len(prompt))
        logits = model(ids[None, a:b], cache=cache).logits[0]                                # [b - a, vocab]
        n = min(b, len(prompt) - 1) - a          # positions of this chunk that predict a prompt token
        lp, tid, tlp = _gather(logits[:n], ids[a + 1 : a + 1 + n], top, rows)
        lps.append(lp)
        tids.append(tid)
        tlps.append(tlp)
        last = logits[-1]
    assert last is not None
    return PromptScores(torch.cat(lps), torch.cat(tids), torch.cat(tlps), last.float().cpu())


@torch.inference_mode()
def score_prompts(model: KimiLinearForCausalLM, prompts: list[list[int]], top: int = 0, chunk: int = 2048,
                  rows: int = 1024) -> list[PromptScores]:
    """Score ``prompts`` (lists of token ids, each non-empty): see :class:`PromptScores`.

    top: alternatives per position (0: none). chunk: prompts together up to this many tokens share one packed
    forward; a longer prompt runs alone in chunks of this size. rows: positions per float32 log-softmax.
    The caller decides the batch: every prompt given is scored by this call.
    """
    if not isinstance(top, int) or top < 0:
        raise ValueError(f"`top` must be an integer >= 0, got {top!r}")
    for name, v in (("chunk", chunk), ("rows", rows)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {v!r}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"`prompts[{i}]` is empty")
    top = min(top, int(model.config.vocab_size))
    out: list[PromptScores | None] = [None] * len(prompts)
    short = [i for i, p in enumerate(prompts) if len(p) <= chunk]
    for i, p in enumerate(prompts):
        if len(p) > chunk:
            out[i] = _chunked(model, p, top, chunk, rows)
    # Short prompts in packs of at most `chunk` tokens, in the given order.
    pack: list[int] = []
    size = 0
    for i in short + [-1]:
        if i < 0 or (pack and size + len(prompts[i]) > chunk):
            for j, s in zip(pack, _packed(model, [prompts[j] for j in pack], top, rows) if pack else []):
                out[j] = s
            pack, size = [], 0
        if i >= 0:
            pack.append(i)
            size += len(prompts[i])
    assert all(s is not None for s in out)
    return out  # type: ignore[return-value]
