"""Autoregressive decoding with the hybrid cache: greedy or sampled, batched with left padding, streamed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from kimi_linear.layers import KDAState

from .paged import DecodeGraphs, DecodePools, decode_step

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
    cuda_graphs: bool | None = None,
) -> Any:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` [B, T].

    attention_mask [B, T]: left padding (0) for batches of unequal prompts; every row then gets the tokens it would
    get alone. Greedy unless ``do_sample``. Rows that emit ``eos_token_id`` are filled with ``pad_token_id`` after
    it; decoding stops when every row has finished. Returns [B, T + n] token ids, or (ids, [n x [B, vocab]] step
    logits) with ``return_logits``.

    cuda_graphs: decode through the fixed-shape step of :mod:`kimi_linear.model.paged` replayed as a CUDA graph
    (KDA states and MLA latents in pools, the paged MLA decode kernel, fused MoE), the engine's fast path.
    ``None``: on for a CUDA model. The pools and graphs are kept on the model for the next call of the same batch
    size while they are large enough and the weights are the same tensors.
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
    use_graphs = input_ids.is_cuda if cuda_graphs is None else cuda_graphs
    decoder = _PagedDecoder(model, cache, attention_mask, B, T + max_new_tokens) if (
        use_graphs and max_new_tokens > 1) else None
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
            logits = decoder.step(nxt) if decoder is not None else model(nxt[:, None], cache=cache).logits[:, -1]
    if streamer is not None:
        streamer.end()
    ids = torch.cat(out, dim=1)
    return (ids, step_logits) if return_logits else ids


class _PagedDecoder:
    """generate's fast path: the prompt's hybrid cache copied into :class:`~kimi_linear.model.paged.DecodePools`
    (slot r = row r, its blocks contiguous), then one fixed-shape step per token (a CUDA graph on a GPU)."""

    def __init__(self, model: KimiLinearForCausalLM, cache: Any, attention_mask: torch.Tensor | None, B: int,
                 max_tokens: int) -> None:
        self.model = model
        device = model.device
        weights = tuple(p.data_ptr() for p in model.parameters())
        held = getattr(model, "_paged_decoder", None)
        if (held is None or held[0] != weights or held[1].block_table.shape[0] - 1 != B
                or held[1].max_tokens < max_tokens):
            # Round the capacity up so that a following call with a somewhat longer prompt reuses the graph.
            cap = min(1 << max(12, (max_tokens - 1).bit_length()),
                      max(max_tokens, model.config.max_position_embeddings))
            pools = DecodePools.allocate(model, B, cap)
            graphs = DecodeGraphs(model, pools, B, capture=device.type == "cuda")
            held = (weights, pools, graphs)
            model._paged_decoder = held
        _, self.pools, self.graphs = held
        pools = self.pools
        lengths = attention_mask.sum(-1) if attention_mask is not None else None
        T = cache.seq_len
        kda = mla = 0
        for c in cache.layers:
            if isinstance(c, KDAState):
                pools.conv[kda][:B].copy_(c.conv)
                pools.rec[kda][:B].copy_(c.recurrent)
                kda += 1
            else:
                per_row = pools.latents[mla][: B * pools.block_table.shape[1]].view(B, pools.max_tokens, -1)
                if lengths is None:
                    per_row[:, :T].copy_(c.buf[:, :T])
                else:
                    for r, n in enumerate(lengths.tolist()):       # left padding: a row's tokens end at T
                        per_row[r, :n].copy_(c.buf[r, T - n : T])
                mla += 1
        self.slots = torch.arange(B, device=device)
        self.lens = (lengths.long() if lengths is not None else torch.full((B,), T, device=device)).to(device)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B] -> next logits [B, vocab] float32 (valid until the next step)."""
        logits = self.graphs.run_device(ids.long(), self.slots, self.lens)
        if logits is None:          # capturing failed (logged): the same step, eagerly
            logits = decode_step(self.model, self.pools, ids.long(), self.slots, self.lens)
        self.lens += 1
        return logits
