"""The models of ``bench/long_context.py``: Kimi-Linear-48B's shape (``kimi-linear-48b`` preset, or cut to fewer
layers) and its all-MLA twin (same widths, every layer MLA), with random weights built directly on the device in
the compute dtype, plus the memory and time arithmetic of ``--plan``.

Building: the model is constructed under ``torch.device(device)`` with the compute dtype as torch's default, so each
weight is allocated once, on the device, in bf16 (48B parameters: ~98 GB; a float32 detour would need 196 GB). The
few weights the model keeps in float32 (router, gate constants) are converted, then ``init_weights`` draws every
value in place on the device (``normal_`` on the bf16 tensors through small per-parameter temporaries).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.config import PRESETS
from kimi_linear.model.memory import cache_bytes
from kimi_linear.model.modeling import keeps_fp32

KINDS = ("hybrid", "mla")
GiB = 2**30


def model_config(kind: str, layers: int | None, max_context: int, smoke: bool, experts: int | None = None) -> Any:
    """``kind`` "hybrid": the preset's layout (KDA, with MLA at every 4th layer and the last: 4, 8, ..., 24, 27 for
    27 layers); "mla": every layer MLA. ``layers`` cuts the depth (default: the preset's); ``max_context``: the
    model's context (the table width of the engine's block table); ``smoke``: the ``tiny`` preset's widths."""
    if kind not in KINDS:
        raise ValueError(f"`--model` must be one of {KINDS}, got {kind!r}")
    base = "tiny" if smoke else "kimi-linear-48b"
    L = layers or PRESETS[base]["num_hidden_layers"]
    if L < 1:
        raise ValueError(f"`--layers` must be >= 1, got {L}")
    mla = [i for i in range(1, L + 1) if kind == "mla" or i % 4 == 0 or i == L]
    lac = dict(PRESETS[base]["linear_attn_config"], kda_layers=[i for i in range(1, L + 1) if i not in mla],
               full_attn_layers=mla)
    extra = {} if experts is None else dict(num_experts=experts)
    return preset_config(base, num_hidden_layers=L, linear_attn_config=lac, model_max_length=max_context, **extra)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _construct(config: Any, device: str, dtype: torch.dtype) -> KimiLinearForCausalLM:
    with torch.device(device), default_dtype(dtype):
        model = KimiLinearForCausalLM(config)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if keeps_fp32(name) and dtype != torch.float64:
            t.data = t.data.float()
    return model


def build(config: Any, device: str, dtype: torch.dtype, seed: int = 0) -> KimiLinearForCausalLM:
    """Random weights, allocated once on ``device`` in ``dtype`` and drawn there (see the module docstring)."""
    model = _construct(config, device, dtype)
    with default_dtype(dtype), torch.no_grad():
        model.init_weights(seed)
    return model.eval()


def meta_model(config: Any, dtype: torch.dtype) -> KimiLinearForCausalLM:
    """The model's modules with shapes and dtypes but no memory (for ``--plan``)."""
    return _construct(config, "meta", dtype)


# ------------------------------------------------------------------------------------------------- memory
def seq_cache_bytes(config: Any, context: int, block_size: int, dtype: torch.dtype) -> int:
    """What the engine allocates for one sequence of ``context`` tokens: one KDA slot and ceil(context / block)
    MLA blocks (``kimi-linear info``'s arithmetic, rounded up to whole blocks)."""
    cb = cache_bytes(config, math.ceil(context / block_size) * block_size, dtype)
    return cb.hybrid


def decode_reserve(config: Any, batch: int) -> int:
    """Working memory a decode step of ``batch`` rows needs beyond weights and pools (a CUDA graph's pool: logits
    in bf16 and float32, read-back temporaries, hidden states, MoE workspace): an estimate with room to spare."""
    return GiB + batch * (config.vocab_size * 10 + 2 * 2**20)


def prefill_reserve(chunk: int) -> int:
    """Working memory of one prompt chunk (hidden states, KDA chunk intermediates, MoE rows, one block of expanded
    MLA keys and the merged outputs): ~384 KiB a token plus 2 GiB, an estimate with room to spare."""
    return 2 * GiB + chunk * 384 * 2**10


# Left free when sizing the largest batch: the decode reserve is an estimate, and allocator fragmentation is real.
HEADROOM = 4 * GiB


def largest_batch(free: int, config: Any, context: int, block_size: int, dtype: torch.dtype, cap: int) -> int:
    """The most sequences of ``context`` tokens whose pools and decode working memory fit in ``free`` bytes, with
    HEADROOM to spare."""
    per = seq_cache_bytes(config, context, block_size, dtype) + config.vocab_size * 10 + 2 * 2**20
    return max(0, min(cap, (free - HEADROOM - GiB) // per))
