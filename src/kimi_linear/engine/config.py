"""Engine settings: pool sizes come from a memory budget (bytes) or explicit counts."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"`memory` must be a size like 2GiB, 512MB or 1000000, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    """How the engine schedules and how big its two cache pools are.

    max_num_seqs: KDA state slots = most sequences running at once (each needs one fixed-size slot).
    memory: bytes for all cache pools (KDA slots + prefix snapshots + MLA blocks); the MLA block count is what is
        left after the fixed parts. Ignored when ``num_blocks`` is given. ``None`` with no ``num_blocks``: room for
        ``max_num_seqs`` sequences of the full context, at most 4 GiB of MLA blocks.
    num_blocks: MLA latent blocks in the paged pool (each ``block_size`` tokens for every MLA layer).
    block_size: tokens per MLA block, and the granularity of prefix sharing. ``None``: 64 on a GPU (one block a key
        tile of the paged decode kernel, as FlashMLA's pages; H200, 1 x 131,072 keys: 76.8 us a call against 79.9
        with 16-token blocks; the engine's batch-1 step at 128k: 0.979 ms against 0.983), 16 on CPU.
    prefill_chunk: most prompt tokens of one sequence in one step (a multiple of ``block_size``). Prompt chunks end
        at multiples of it, and the KDA state is snapshotted there for prefix caching: it is the prefix-cache
        granularity of the KDA layers. ``None``: 64 on CPU, 2048 on a GPU.
    max_num_batched_tokens: the step's token budget: decode rows (one token each) plus prompt chunks; chunks of
        equal length from several sequences run as one batched forward. At least one chunk runs per step whatever
        the budget, so prompts always progress. ``None``: ``prefill_chunk`` on CPU (one chunk beside the decode
        rows, which keeps their latency low), 32768 on a GPU (where a forward of thousands of tokens costs about
        what one of a few hundred does; H200, 2026-12-02, 32 prompts of 2,048 tokens on the 8-layer 48B shape:
        84% of one bare forward's tokens/s with 32768, 71% with 16384; the fused MoE's float32 partial sums then
        take ~2.7 GB per forward beside the cache budget).
    mixed_steps: a step with prompt chunks runs its decode rows and its chunks as one forward (the sequences
        packed into one row: varlen ``chunk_kda`` from each slot's state, MLA over each sequence's own latents)
        instead of a decode forward plus batched chunk forwards. Default off: on CPU it is slower (the shipped
        model, 24 requests of 64-255 prompt tokens and 48 new ones, 16 slots: 122-132 against 211-241 output
        tok/s, same tokens; one-token rows pay the chunked kernel and the packed MLA layout), and on a GPU it is
        not measured yet (its decode rows leave their CUDA graph for that step).
    max_num_scored_tokens: prompt tokens scored in one forward for requests that ask for their prompt's
        log-probs (``SamplingParams.prompt_logprobs``): such prompts are packed into one row up to this many tokens
        (a longer one runs alone, this many tokens per forward through the hybrid cache). The packed forward's MLA
        mask is [T, T] and its logits [T, vocab] in the model dtype (8192 x 163840 in bf16: 2.7 GB, outside the
        cache budget ``memory``), so this bounds its memory. ``None``: 2048 on CPU, 8192 on a GPU.
    prefix_caching: share full MLA blocks by hash chain and restore KDA snapshots.
    num_snapshots: KDA snapshot slots for prefix caching (LRU); default ``4 * max_num_seqs``.
    cuda_graphs: run batched decode steps through the fixed-shape step of ``kimi_linear.model.paged`` (KDA states
        updated in place in their slots, MLA latents read through the block table), captured as one CUDA graph
        per batch bucket (1, 2, 4, ..., ``max_num_seqs``) whatever the context length. ``None``: on for a CUDA
        model, off otherwise. ``True`` on CPU runs the same fixed-shape step eagerly (what the tests check;
        slower than the normal CPU path).
    pipeline_decode: pipelined greedy decoding on the fixed-shape step: while every running sequence decodes
        greedily (no log-probs) and nothing else is pending (no prompt chunk, no request that could be admitted, no
        prompt to score), each :meth:`~.engine.LLMEngine.step` launches the next decode step, fed on the device with
        the greedy ids of the step in flight, before it reads that step's tokens back and does their bookkeeping:
        the engine's host work overlaps the GPU's. Same tokens and outputs as without it (the module docstring of
        :mod:`~.engine` says how and what differs: a step may run one more forward after an EOS). ``None``: on
        when ``cuda_graphs`` is (also on CPU, where the fixed-shape step runs eagerly: what the tests check);
        ``True`` needs ``cuda_graphs``.
    """

    max_num_seqs: int = 16
    memory: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    prefill_chunk: int | None = None
    max_num_batched_tokens: int | None = None
    mixed_steps: bool = False
    max_num_scored_tokens: int | None = None
    prefix_caching: bool = True
    num_snapshots: int | None = None
    cuda_graphs: bool | None = None
    pipeline_decode: bool | None = None

    def resolved(self, device_type: str) -> EngineConfig:
        """A validated copy with the device-dependent defaults (``None`` fields) filled in."""
        gpu = device_type == "cuda"
        cfg = EngineConfig(**{**self.__dict__})
        if cfg.block_size is None:
            cfg.block_size = 64 if gpu else 16
        if cfg.prefill_chunk is None:
            cfg.prefill_chunk = max(2048 if gpu else 64, cfg.block_size) // cfg.block_size * cfg.block_size
        if cfg.max_num_batched_tokens is None:
            cfg.max_num_batched_tokens = 32768 if gpu else cfg.prefill_chunk
        if cfg.max_num_scored_tokens is None:
            cfg.max_num_scored_tokens = 8192 if gpu else 2048
        if cfg.cuda_graphs is None:
            cfg.cuda_graphs = gpu
        if cfg.pipeline_decode is None:
            cfg.pipeline_decode = cfg.cuda_graphs
        return cfg.validate()

    def validate(self) -> EngineConfig:
        for name in ("max_num_seqs", "block_size", "prefill_chunk", "max_num_batched_tokens", "max_num_scored_tokens"):
            v = getattr(self, name)
            if v is None and name != "max_num_seqs":
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"`{name}` must be a positive int, got {v!r}")
        if self.prefill_chunk is not None and self.block_size is not None and self.prefill_chunk % self.block_size:
            raise ValueError(f"`prefill_chunk` ({self.prefill_chunk}) must be a multiple of `block_size` "
                             f"({self.block_size})")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"`num_blocks` must be >= 1, got {self.num_blocks}")
        if self.num_snapshots is not None and self.num_snapshots < 0:
            raise ValueError(f"`num_snapshots` must be >= 0, got {self.num_snapshots}")
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"`cuda_graphs` must be True, False or None (auto), got {self.cuda_graphs!r}")
        if self.pipeline_decode not in (None, True, False):
            raise ValueError(f"`pipeline_decode` must be True, False or None (auto), got {self.pipeline_decode!r}")
        if self.pipeline_decode and self.cuda_graphs is False:
            raise ValueError("`pipeline_decode` needs the fixed-shape decode step (`cuda_graphs`)")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"`memory` must be > 0 bytes, got {self.memory}")
        return self
