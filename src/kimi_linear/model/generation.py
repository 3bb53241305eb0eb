"""Autoregressive decoding with the hybrid cache: greedy or sampled, batched with left padding, streamed, with
transformers' generation arguments (:mod:`.generation_config`, :mod:`.logits_processors`)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig

from kimi_linear.layers import KDAState

from .arg_checks import check_seed
from .generation_config import resolve_options
from .logits_processors import TokenRules
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
    generation_config: GenerationConfig | None = None,
    *,
    tokenizer: Any = None,
    seed: int | None = None,
    streamer: Streamer | None = None,
    return_logits: bool = False,
    cuda_graphs: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Generate tokens after ``input_ids`` [B, T], taking transformers' ``generate`` arguments for the tokens.

    attention_mask [B, T]: left padding (0) for batches of unequal prompts; every row then gets the tokens it would
    get alone. Returns [B, T + n] token ids, or (ids, [n x [B, vocab]] raw step logits) with ``return_logits``.

    Keyword arguments, as in transformers (each overrides ``generation_config``, which overrides the model's
    ``generation_config``: its checkpoint's ``generation_config.json``, else EOS / PAD of ``config.json``):

    - ``max_new_tokens``, or ``max_length`` (prompt included); neither set anywhere: 20 new tokens. Capped at the
      context (``max_position_embeddings``) with a warning.
    - ``min_new_tokens`` / ``min_length``: EOS cannot be chosen before.
    - ``do_sample`` (default greedy), ``temperature``, ``top_k`` (default 50, 0 = off), ``top_p``; a temperature
      below 0.01 decodes greedily, as the server does. ``seed`` (ours): a private generator, reproducible.
    - ``repetition_penalty``: logits of tokens already in the prompt or the output are divided by it (multiplied
      when negative).
    - ``eos_token_id`` (an id or a list; ``None`` = no EOS) and ``pad_token_id`` (fills a row after it ended).
    - ``stop_strings`` with ``tokenizer=``: a row ends once its text ends in one (the tokens that complete it are
      kept, as in transformers).

    Decoding stops when every row has ended. Options of transformers' generate that are not implemented (beam
    search ...) raise ``ValueError`` when they would change the tokens.

    cuda_graphs: decode through the fixed-shape step of :mod:`kimi_linear.model.paged` replayed as a CUDA graph
    (KDA states and MLA latents in pools, the paged MLA decode kernel, fused MoE), the engine's fast path.
    ``None``: on for a CUDA model. The pools and graphs are kept on the model for the next call of the same batch
    size while they are large enough and the weights are the same tensors. Sampling and the rules above run
    outside the graph, on the logits either path returns.
    """
    input_ids = model._check_input_ids(input_ids)
    B, T = input_ids.shape
    opts = resolve_options(getattr(model, "generation_config", None), generation_config, kwargs, T,
                           model.config.vocab_size, tokenizer is not None)
    check_seed(seed)
    limit = model.config.max_position_embeddings
    if T > limit:
        raise ValueError(f"prompt of {T} tokens exceeds the configured context `max_position_embeddings`/"
                         f"`model_max_length` = {limit}")
    max_new_tokens = opts.max_new_tokens
    if max_new_tokens > limit - T:
        if "max_new_tokens" in kwargs or "max_length" in kwargs:
            warnings.warn(f"{max_new_tokens} new tokens after a prompt of {T} exceed the context of {limit}: "
                          f"capped at {limit - T}", stacklevel=4)
        max_new_tokens = limit - T
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"`attention_mask` must have the shape of `input_ids` {tuple(input_ids.shape)}, got "
                             f"{tuple(attention_mask.shape)}")
        _check_left_padded(attention_mask)
    generator = torch.Generator(device=input_ids.device).manual_seed(seed) if seed is not None else None
    rules = TokenRules(opts, input_ids, attention_mask, model.config.vocab_size, tokenizer)

    cache = model.new_cache(B)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    # seq [B, T + max_new_tokens]: the prompt, then each step's tokens (stop strings read its tail).
    seq = torch.cat([input_ids.long(), input_ids.new_zeros(B, max_new_tokens, dtype=torch.long)], dim=1)
    n = 0
    step_logits = []
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    eos_t = rules.eos
    can_finish = eos_t is not None or rules.stop is not None
    logits = model(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
    use_graphs = input_ids.is_cuda if cuda_graphs is None else cuda_graphs
    decoder = _PagedDecoder(model, cache, attention_mask, B, T + max_new_tokens) if (
        use_graphs and max_new_tokens > 1) else None
    for step in range(max_new_tokens):
        if return_logits:
            step_logits.append(logits.float().clone())
        if rules.active:
            logits = rules.process(logits)
        if opts.do_sample:
            nxt = sample_next(logits, opts.temperature, opts.top_k, opts.top_p, generator)
        else:
            nxt = logits.argmax(-1)
        if can_finish:      # without EOS or stop strings no row ends early: two kernels a token saved
            nxt = torch.where(finished, torch.full_like(nxt, opts.pad_token_id), nxt)
        seq[:, T + step] = nxt
        n = step + 1
        rules.update(nxt)
        if streamer is not None:
            streamer.put(nxt.cpu())
        ended = torch.isin(nxt, eos_t) if eos_t is not None else None
        stopped = rules.stopped(seq[:, : T + n])
        if stopped is not None:
            ended = stopped if ended is None else ended | stopped
        if ended is not None:
            finished |= ended
            if bool(finished.all()):
                break
        if step + 1 < max_new_tokens:
            logits = decoder.step(nxt) if decoder is not None else model(nxt[:, None], cache=cache).logits[:, -1]
    if streamer is not None:
        streamer.end()
    ids = seq[:, : T + n]
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
        self.started = False        # after the first step, the graphs' input buffer only moves on (run_next)

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B] -> next logits [B, vocab] float32 (valid until the next step)."""
        ids = ids.long()
        logits = self.graphs.run_next(ids) if self.started else self.graphs.run_device(ids, self.slots, self.lens)
        if logits is None:          # capturing failed (logged): the same step, eagerly
            logits = decode_step(self.model, self.pools, ids, self.slots, self.lens)
            self.lens += 1          # (on the graphs' path the lengths live in their input buffer)
        else:
            self.started = True
        return logits
