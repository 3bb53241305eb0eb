"""The serving engine: continuous batching over a KDA state-slot pool and a paged MLA latent pool.

Each :meth:`LLMEngine.step` admits waiting requests (FIFO, while a state slot and enough blocks are free), runs
one batched decode forward for every running sequence that has exactly one uncomputed token, then one prefill
chunk of a request still reading its prompt. Prefill chunks run one request at a time: the KDA layer handles
padding by zeroing inputs, which is exact only for left padding of a fresh sequence, so a running sequence is
never padded. Decode rows of different lengths are aligned by left-padding their MLA latents (masked keys).

With ``cuda_graphs`` (default on for a CUDA model) the decode forward goes through the fixed-shape step of
``cuda_graph.py`` instead, replayed as a CUDA graph per (batch, context) bucket; batches it does not cover run the
eager forward above.
"""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from kimi_linear.layers import LatentCache
from kimi_linear.model.cache import HybridCache

from .config import EngineConfig
from .cuda_graph import DecodeGraphs
from .pools import BlockPool, SnapshotCache, StatePool
from .sampling import SamplingParams, sample, token_logprobs
from .sequence import RequestOutput, Sequence, Status

DEFAULT_MLA_BYTES = 4 * 2**30


class LLMEngine:
    """Synchronous engine; drive it with :meth:`step` (the server runs it in a background thread)."""

    def __init__(self, model: Any, config: EngineConfig | None = None, tokenizer: Any = None) -> None:
        self.model = model.eval()
        self.cfg = (config or EngineConfig()).validate()
        self.tokenizer = tokenizer
        mc = model.config
        layers = model.model.layers
        self.kda_idx = [i for i, layer in enumerate(layers) if layer.is_kda]
        self.mla_idx = [i for i, layer in enumerate(layers) if not layer.is_kda]
        dtype, device = model.dtype, model.device
        self.device = device
        self.max_context = int(mc.max_position_embeddings)
        self.vocab_size = int(mc.vocab_size)
        eos = mc.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        S = self.cfg.max_num_seqs
        kda_mods = [layers[i].self_attn for i in self.kda_idx]
        self.widths = [layers[i].self_attn.cache_width for i in self.mla_idx]
        graphs = self.cfg.cuda_graphs if self.cfg.cuda_graphs is not None else device.type == "cuda"
        # The fixed-shape decode step pads batches with rows that use one extra slot and block (scratch).
        self.slots = StatePool(S, kda_mods, dtype, device, scratch=graphs)
        n_snap = self.cfg.num_snapshots if self.cfg.num_snapshots is not None else 4 * S
        self.snapshots = SnapshotCache(StatePool(n_snap if self.cfg.prefix_caching else 0, kda_mods, dtype, device))
        bs = self.cfg.block_size
        block_bytes = bs * sum(self.widths) * torch.tensor([], dtype=dtype).element_size()
        num_blocks = self.cfg.num_blocks
        if num_blocks is None:
            if self.cfg.memory is not None and block_bytes:
                left = self.cfg.memory - self.slots.nbytes() - self.slots.scratch_bytes() - self.snapshots.pool.nbytes()
                num_blocks = left // block_bytes - int(graphs)
                if num_blocks < 1:
                    raise ValueError(
                        f"`memory` = {self.cfg.memory} bytes is too small: {S} KDA slots + {n_snap} snapshots take "
                        f"{self.slots.nbytes() + self.snapshots.pool.nbytes()} bytes and one MLA block "
                        f"{block_bytes}; raise `memory` or lower `max_num_seqs` / `num_snapshots`")
            else:
                # Room for max_num_seqs full-context sequences, but at most DEFAULT_MLA_BYTES (a 1M-token context
                # would otherwise ask for >100 GB); --memory / num_blocks choose more.
                num_blocks = S * math.ceil(self.max_context / bs)
                if block_bytes:
                    num_blocks = max(1, min(num_blocks, DEFAULT_MLA_BYTES // block_bytes))
        self.blocks = BlockPool(int(num_blocks), bs, self.widths, dtype, device, scratch=graphs)
        self.graphs = DecodeGraphs(
            model, self.slots, self.blocks, self.kda_idx, self.mla_idx, S,
            min(self.cfg.cuda_graph_max_len, self.max_context), capture=device.type == "cuda",
        ) if graphs else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.counters = dict(prompt_tokens=0, generation_tokens=0, prefill_tokens=0, prefix_cache_hit_tokens=0,
                             prefix_cache_queries=0, prefix_cache_hits=0, preemptions=0, requests_finished=0,
                             requests_aborted=0, steps=0, decode_forwards=0, prefill_forwards=0,
                             graph_decode_forwards=0)
        self._hold_admission = False                            # set by a preemption, cleared by a finish
        self._recent: deque[tuple[float, int]] = deque()        # (time, tokens) for tokens/s

    # ------------------------------------------------------------------------------------------- bookkeeping
    def allocated_bytes(self) -> dict[str, int]:
        """Bytes the pools hold: KDA state slots, KDA prefix snapshots, MLA latent blocks (and, with CUDA graphs,
        the padding rows' scratch slot and block)."""
        out = dict(kda_slots=self.slots.nbytes(), kda_snapshots=self.snapshots.pool.nbytes(),
                   mla_blocks=self.blocks.nbytes())
        if self.graphs is not None:
            out["graph_scratch"] = self.slots.scratch_bytes() + self.blocks.scratch_bytes()
        return out

    def capture_cuda_graphs(self) -> int:
        """Capture the decode graphs of every (batch, context) bucket now instead of on first use (a server does
        this at start-up). Returns how many graphs are held (0 without CUDA graphs)."""
        if self.graphs is None or not self.graphs.capture:
            return 0
        return self.graphs.capture_all()

    def token_capacity(self) -> int:
        return self.blocks.num_blocks * self.cfg.block_size if self.widths else self.max_context

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the field) for a request the engine can never serve."""
        params.validate()
        if not prompt_ids:
            raise ValueError("`prompt` is empty")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"`prompt` holds token id {bad[0]!r}, outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_ids)
        if n >= self.max_context:
            raise ValueError(f"`prompt` has {n} tokens; the model's context is {self.max_context} tokens, leaving "
                             "no room for a completion")
        if n + 1 > self.token_capacity():
            raise ValueError(f"`prompt` has {n} tokens; the MLA cache pool holds {self.token_capacity()} tokens "
                             "in all (raise the server's --memory)")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    on_output: Callable[[RequestOutput], Any] | None = None) -> Sequence:
        self.check_request(prompt_ids, params)
        if request_id in self.by_id:
            raise ValueError(f"request id {request_id!r} is already in use")
        decode = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            decode = lambda ids: tok.decode(ids, skip_special_tokens=True)
        seq = Sequence(request_id, prompt_ids, params, on_output, decode, self.eos_ids)
        # A sequence can always finish alone: cap its length by the context and by the pool.
        room = min(self.max_context, self.token_capacity()) - len(prompt_ids)
        seq.max_tokens = min(params.max_tokens, room)
        seq.length_capped = seq.max_tokens < params.max_tokens
        self.counters["prompt_tokens"] += len(prompt_ids)
        if seq.max_tokens == 0:
            self._finish(seq, "length", emit=True)
            return seq
        self.by_id[request_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request (client gone): its slot and blocks are freed at once."""
        seq = self.by_id.get(request_id)
        if seq is None:
            return False
        self.counters["requests_aborted"] += 1
        self._finish(seq, "abort", emit=True)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1.0) if self._recent else 1.0
        return dict(
            running=len(self.running), waiting=len(self.waiting),
            kda_slots_used=self.slots.num_slots - len(self.slots.free), kda_slots_total=self.slots.num_slots,
            kda_snapshots_used=len(self.snapshots.slot_of), kda_snapshots_total=self.snapshots.pool.num_slots,
            mla_blocks_used=self.blocks.num_used(), mla_blocks_cached_free=len(self.blocks.free_cached),
            mla_blocks_total=self.blocks.num_blocks,
            generation_tokens_per_s=sum(n for _, n in self._recent) / span,
            **self.counters,
        )

    # -------------------------------------------------------------------------------------------- prefix cache
    def _block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash chain over full blocks: block i's hash covers every token before its end."""
        hs = seq.__dict__.setdefault("hashes", [])
        toks = None
        while len(hs) <= i:
            toks = toks or seq.tokens
            j, bs = len(hs), self.cfg.block_size
            # A cryptographic digest, not Python's hash(): int-tuple hashes are not randomised, so crafted
            # prompts could collide with another client's prefix and read its cache.
            data = (hs[-1] if hs else b"") + array("q", toks[j * bs : (j + 1) * bs]).tobytes()
            hs.append(hashlib.blake2b(data, digest_size=16).digest())
        return hs[i]

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], bytes | None]:
        """Longest run of cached full blocks that ends where a KDA snapshot exists (>= 1 token left to run)."""
        if not self.cfg.prefix_caching:
            return [], None
        bs = self.cfg.block_size
        found: list[int] = []
        best, best_h = 0, None
        for i in range((seq.num_tokens() - 1) // bs):
            h = self._block_hash(seq, i)
            b = self.blocks.block_of.get(h)
            if b is None:
                break
            found.append(b)
            if h in self.snapshots:
                best, best_h = i + 1, h
        return found[:best], best_h

    # --------------------------------------------------------------------------------------------- scheduling
    def _admit(self) -> None:
        bs = self.cfg.block_size
        while self.waiting and self.slots.free:
            seq = self.waiting[0]
            shared, h = self._match_prefix(seq)
            revived = sum(1 for b in shared if self.blocks.ref[b] == 0)
            need = math.ceil((seq.num_tokens() + 1) / bs) - len(shared)
            # Headroom of one block per running sequence, and no admission after a preemption until something
            # finishes: otherwise the victim is readmitted at once, recomputed, and preempted again (thrashing).
            headroom = len(self.running)
            if self.running and (self._hold_admission or need > self.blocks.num_free() - revived - headroom):
                break                                   # head of line waits for blocks (FIFO, no starvation)
            if need > self.blocks.num_free() - revived:
                break
            self.waiting.popleft()
            seq.slot = self.slots.alloc()
            for b in shared:
                self.blocks.incref(b)
            seq.block_table = list(shared)
            seq.num_hashed = len(shared)
            if h is not None:
                self.snapshots.restore(h, self.slots, seq.slot)
            else:
                self.slots.reset(seq.slot)
            seq.num_computed = len(shared) * bs
            seq.prefill_target = seq.num_tokens()       # tokens to (re)compute before decoding new ones
            if not seq.admitted_once:
                self.counters["prefix_cache_queries"] += 1
                self.counters["prefix_cache_hits"] += bool(shared)
                self.counters["prefix_cache_hit_tokens"] += seq.num_computed
                seq.cached_tokens = seq.num_computed
                seq.admitted_once = True
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _release(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self.blocks.decref(b)
        seq.block_table = []
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        seq.num_computed = seq.num_hashed = 0

    def _preempt(self, seq: Sequence) -> None:
        """Give back a running sequence's slot and blocks; it is recomputed from its tokens when readmitted."""
        self.counters["preemptions"] += 1
        self._hold_admission = True
        self._release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, upto: int) -> bool:
        """Blocks for tokens [0, upto); preempts the newest other running sequences if needed. False if ``seq``
        itself had to be preempted."""
        need = math.ceil(upto / self.cfg.block_size) - len(seq.block_table)
        while need > 0:
            b = self.blocks.alloc()
            if b is None:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    return False
                continue
            seq.block_table.append(b)
            need -= 1
        return True

    def _finish(self, seq: Sequence, reason: str, emit: bool) -> None:
        if seq.status == Status.FINISHED:
            return
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._hold_admission = False
        self.by_id.pop(seq.request_id, None)
        if reason != "abort":
            self.counters["requests_finished"] += 1
        if emit:
            text, _ = seq.detok.update(seq.output_ids, True) if reason != "abort" else ("", False)
            self._emit(seq, text)

    def _emit(self, seq: Sequence, text: str) -> None:
        final = seq.status == Status.FINISHED
        out = RequestOutput(
            request_id=seq.request_id, token_ids=seq.pending, text=text, finished=final,
            finish_reason=seq.finish_reason if final else None, logprobs=seq.pending_lp,
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens,
        )
        seq.pending, seq.pending_lp = [], []
        if seq.on_output is not None:
            seq.on_output(out)

    # ------------------------------------------------------------------------------------------------- forward
    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence], T: int) -> torch.Tensor:
        """Run tokens [num_computed, num_computed + T) of each sequence (T > 1 only for a single sequence) through
        the model with caches gathered from the pools, write the new state / latents back. Returns last-position
        logits [B, vocab] float32."""
        B = len(seqs)
        ps = [s.num_computed for s in seqs]
        L = max(ps)
        cache = HybridCache([None] * len(self.model.model.layers))  # type: ignore[list-item]
        for k, st in zip(self.kda_idx, self.slots.gather([s.slot for s in seqs])):
            cache.layers[k] = st
        bufs = []
        for li, w in zip(self.mla_idx, self.widths):
            lc = LatentCache(B, w, self.model.dtype, self.device)
            lc.buf = torch.zeros(B, L + T, w, dtype=self.model.dtype, device=self.device)
            lc.length = L
            cache.layers[li] = lc
            bufs.append(lc.buf)
        for r, s in enumerate(seqs):
            if ps[r]:
                for buf, e in zip(bufs, self.blocks.gather(s.block_table, ps[r])):
                    buf[r, L - ps[r] : L] = e
        cache.seq_len = L
        if any(p != L for p in ps):
            cache.key_mask = torch.arange(L, device=self.device)[None] >= torch.tensor(
                [L - p for p in ps], device=self.device)[:, None]
        ids = torch.tensor([s.tokens[s.num_computed : s.num_computed + T] for s in seqs], device=self.device)
        logits = self.model(ids, cache=cache, logits_to_keep=1).logits[:, -1].float()
        self.slots.scatter([s.slot for s in seqs], [cache.layers[k] for k in self.kda_idx])
        for r, s in enumerate(seqs):
            self.blocks.write(s.block_table, ps[r], [buf[r, L : L + T] for buf in bufs])
        self._advance(seqs, T)
        return logits

    def _advance(self, seqs: list[Sequence], T: int) -> None:
        """Count ``T`` more computed tokens per sequence (after their state and latents are in the pools)."""
        for s in seqs:
            # Prompt (or recomputed) tokens count as prefill even when the last one rides in a decode batch.
            self.counters["prefill_tokens"] += max(0, min(s.num_computed + T, s.prefill_target) - s.num_computed)
            s.num_computed += T

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token of every sequence: through the CUDA-graph step when a bucket covers the batch, else eagerly.
        Returns logits [B, vocab] float32."""
        if self.graphs is not None:
            logits = self.graphs.run(seqs)
            if logits is not None:
                self.counters["graph_decode_forwards"] += 1
                self._advance(seqs, 1)
                return logits
        return self._forward(seqs, 1)

    def _after_forward(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Sample when the sequence has caught up with its tokens; check stop conditions; emit. ``greedy``: the
        argmax of ``logits`` when already known (a GPU batch computes all of them with one read-back)."""
        if seq.num_computed < seq.num_tokens():
            return
        p = seq.params
        if logits.device.type != "cpu" and (greedy is None or p.temperature != 0 or p.logprobs is not None):
            logits = logits.cpu()        # the request's generator lives on the CPU; log-probs read many values
        tok = greedy if greedy is not None and p.temperature == 0 else sample(logits, p, seq.generator)
        seq.output_ids.append(tok)
        seq.pending.append(tok)
        if p.logprobs is not None:
            lp, alts = token_logprobs(logits, tok, p.logprobs)
            seq.pending_lp.append((tok, lp, alts))
        self.counters["generation_tokens"] += 1
        self._recent.append((time.monotonic(), 1))
        reason = None
        if tok in seq.stop_ids:
            reason = "stop"
        elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens() >= self.max_context:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason, emit=True)
            return
        text, hit = seq.detok.update(seq.output_ids, False)
        if hit:     # a stop string: the detokenizer already cut the text before it
            self._finish(seq, "stop", emit=False)
            self._emit(seq, text)
        else:
            self._emit(seq, text)

    def _register_blocks(self, seq: Sequence, snapshot: bool) -> None:
        if not self.cfg.prefix_caching:
            return
        bs = self.cfg.block_size
        full = seq.num_computed // bs
        for i in range(seq.num_hashed, full):
            self.blocks.register(seq.block_table[i], self._block_hash(seq, i))
        seq.num_hashed = max(seq.num_hashed, full)
        if snapshot and full and seq.num_computed % bs == 0:
            self.snapshots.save(self._block_hash(seq, full - 1), self.slots, seq.slot)

    # ---------------------------------------------------------------------------------------------------- step
    def step(self) -> None:
        """One scheduling round: admit, one batched decode forward, up to ``max_prefill_forwards`` prefill chunks."""
        self.counters["steps"] += 1
        self._admit()
        decode = [s for s in self.running if s.num_tokens() - s.num_computed == 1]
        ok = []
        for s in decode:
            if s.status == Status.RUNNING and self._reserve(s, s.num_computed + 1):
                ok.append(s)
        ok = [s for s in ok if s.status == Status.RUNNING]
        if ok:
            self.counters["decode_forwards"] += 1
            logits = self._decode(ok)
            # On a GPU, one read-back for every greedy row instead of one per row.
            greedy = logits.argmax(-1).tolist() if logits.device.type != "cpu" else [None] * len(ok)
            for r, s in enumerate(ok):
                self._after_forward(s, logits[r], greedy[r])
        chunk = self.cfg.prefill_chunk
        for _ in range(self.cfg.max_prefill_forwards):
            pre = next((s for s in self.running if s.num_tokens() - s.num_computed > 1), None)
            if pre is None:
                break
            p, n = pre.num_computed, pre.num_tokens()
            end = min((p // chunk + 1) * chunk, n)
            # Also stop at the prompt's last full block, so a later prompt that extends this one (the next turn
            # of a chat, a retry) finds a KDA snapshot there.
            last_full = n // self.cfg.block_size * self.cfg.block_size
            if self.cfg.prefix_caching and p < last_full < end:
                end = last_full
            T = end - p
            if not self._reserve(pre, p + T):
                continue
            self.counters["prefill_forwards"] += 1
            logits = self._forward([pre], T)
            self._register_blocks(pre, snapshot=True)
            self._after_forward(pre, logits[0])
        if not self.running and self.waiting:
            # Nothing runs and the head could not be admitted with every block free: the pool is too small for
            # it (check_request rules this out); fail it rather than spin.
            self._finish(self.waiting[0], "error", emit=True)
