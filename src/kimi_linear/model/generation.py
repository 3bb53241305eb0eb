"""Autoregressive decoding with the hybrid cache: greedy or sampled, batched with left padding, streamed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .modeling import KimiLinearForCausalLM


class Streamer(Protocol):
    """transformers' streamer protocol (``TextStreamer`` works): ``put`` gets the prompt once, then each step's
    new tokens [B]; ``end`` is called once at the end."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


def sample_next(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits [B, vocab] -> token ids [B]: temperature, then top-k, then nucleus (top-p) filtering."""
    logits = logits.float() / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1)[0][..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_left_padded(mask: torch.Tensor) -> None:
    # Left padding means each row is 0...0 1...1: the mask never goes from 1 back to 0.
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("`attention_mask` must be left-padded (zeros only before a row's tokens); right padding "
                         "would put padding between the prompt and the generated tokens")
    if bool((mask.sum(-1) == 0).any()):
        raise ValueError("`attention_mask` has a row with no tokens")


@torch.inference_mode()
def generate(
    model: KimiLinearForCausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer: Streamer | None = None,
    return_logits: bool = False,
) -> Any:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` [B, T].

    attention_mask [B, T]: left padding (0) for batches of unequal prompts; every row then gets the tokens it would
    get alone. Greedy unless ``do_sample``. Rows that emit ``eos_token_id`` are filled with ``pad_token_id`` after
    it; decoding stops when every row has finished. Returns [B, T + n] token ids, or (ids, [n x [B, vocab]] step
    logits) with ``return_logits``.
    """
    input_ids = model._check_input_ids(input_ids)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"`max_new_tokens` must be a non-negative int, got {max_new_tokens!r}")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"`temperature` must be > 0 when sampling, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"`top_k` must be >= 0, got {top_k}")
    B, T = input_ids.shape
    limit = model.config.max_position_embeddings
    if T > limit:
        raise ValueError(f"prompt of {T} tokens exceeds the configured context `max_position_embeddings`/"
                         f"`model_max_length` = {limit}")
    max_new_tokens = min(max_new_tokens, limit - T)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
        _check_left_padded(attention_mask)
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    if pad_token_id is None:
        pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else (eos[0] if eos else 0)
    generator = torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None

    cache = model.new_cache(B)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = [input_ids]
    step_logits = []
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    eos_t = torch.tensor(eos, device=input_ids.device) if eos else None
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    for step in range(max_new_tokens):
        if return_logits:
            step_logits.append(logits.float().clone())
        if do_sample:
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(finished, torch.full_like(nxt, pad_token_id), nxt)
        out.append(nxt[:, None])
        if streamer is not None:
            streamer.put(nxt.cpu())
        if eos_t is not None:
            finished |= torch.isin(nxt, eos_t)
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            logits = model(nxt[:, None], cache=cache).logits[:, -1]
    if streamer is not None:
        streamer.end()
    ids = torch.cat(out, dim=1)
    return (ids, step_logits) if return_logits else ids
