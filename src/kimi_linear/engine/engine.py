"""The serving engine: continuous batching over a KDA state-slot pool and a paged MLA latent pool.

The engine is the thin loop between three parts, each in its own module:

- :class:`~.scheduler.Scheduler` admits waiting requests (FIFO, while a state slot and enough blocks are free),
  preempts when the block pool runs dry, and plans each step: every running sequence with exactly one uncomputed
  token decodes, then prompt chunks run under the step's token budget (``max_num_batched_tokens``);
- :class:`~.cache_manager.CacheManager` owns the pools: KDA slots, KDA prefix snapshots, MLA blocks with prefix
  hashes, and (with the fixed-shape decode step) the device block table;
- :class:`~.model_runner.ModelRunner` runs the forwards: decode rows through the fixed-shape step of
  :mod:`kimi_linear.model.paged` (one CUDA graph per batch bucket on a GPU), prompt chunks eagerly, batched by
  length.

After each forward :meth:`LLMEngine.step` samples, checks stop conditions and emits outputs.

Requests that ask for their prompt's log-probabilities (``SamplingParams.prompt_logprobs``: ``echo`` with
``logprobs``, evaluation harnesses) first wait in a scoring queue: each step scores the prompts at its head in one
packed forward (up to ``max_num_scored_tokens``) outside the pools, samples each request's first token from the
logits after its prompt, and then either finishes it (``max_tokens`` 0 or 1, a stop) or hands it to the scheduler,
which prefills prompt and first token into the pools and decodes the rest as usual.

Pipelined greedy decoding (``EngineConfig.pipeline_decode``, on with the fixed-shape step). A serial step leaves
the GPU idle during all of its host work: plan, sync the block table, build the inputs, copy them, replay, read the
greedy ids back (``.tolist()`` waits for the GPU), then per row append, check stops, detokenize, emit. On an H200
that is ~0.1 ms of a 3 ms batch-1 step. Like vLLM's "async scheduling", a pipelined round instead

1. launches decode step N: its blocks reserved, its block-table entries and slot / length inputs copied through
   page-locked memory (nothing waits for the device), its input ids written on the device from step N-1's greedy
   ids (:meth:`DecodeGraphs.launch <kimi_linear.model.paged.DecodeGraphs.launch>`), ``num_computed`` advanced; its
   greedy ids then start their copy to a page-locked host buffer, with a CUDA event recorded after it
   (:class:`~.pipeline.InFlight`; on a CPU the eager step computes them with ``greedy_ids`` and the copy is plain);
2. then waits for step N-1's event alone (not for step N) and emits its tokens as :meth:`_after_forward` would.

So the host work of a round runs while the GPU computes step N. Only the common case is pipelined: decode-only
rounds on the fixed-shape step where every row is greedy without log-probs and nothing else is pending (no prompt
chunk, no prompt to score, no waiting request that could be admitted: a free slot and admission not held). A
sampled row draws from its own generator on the host and a log-prob row reads its logits there, so their next
input exists only after a read-back: they stay serial. Any other round first *drains* (reads back and emits the
step in flight), then runs serially exactly as before; the first pipelined round after a serial one takes its
input ids from the host and emits nothing yet.

What the design has to get right, and how:

- A row whose step N-1 token ends it *by length* (``max_tokens``, the context) is known in advance: step N leaves
  it out, so no step runs for a sequence past its length (and when a request waits, the round drains instead, so
  that the freed slot is filled in the same step as serially). A row that step N-1 ends by EOS, a stop id, a stop
  string or an error cannot be known at launch: it rides in step N, whose token for it is discarded when N is read
  back (``discarded_tokens``); its slot and blocks are released at once, as :meth:`_finish` does, which is safe
  because all device work is stream-ordered (any later user of that slot or block runs after step N), and step N
  writes only its own, unregistered, current block. :meth:`abort` of a row in flight works the same way. A row of
  NaN logits (greedy id -1) is fed to step N as token 0 and fails as it would serially.
- Blocks are taken without preemption or eviction: a round whose rows need more blocks than are plainly free
  drains and lets the serial planner preempt. A round reads the step it launched back at once when none of its
  rows can go on (all end by length, or all ended while the step before was emitted), and :meth:`abort` of the
  last live row in flight drains it, so a step is not left in flight with nothing to emit; :meth:`has_work` is
  true while one is, so ``while has_work(): step()`` emits everything.
- Outputs are token for token those of the serial engine, with the same outputs per request (tokens, texts,
  finish reasons, counts): a row's math does not depend on when its tokens are read back. What may differ: after an
  EOS / stop the finished row rides in one more forward (so ``decode_forwards`` can be one higher, and a request
  waiting for that row's slot starts one step later), and on a GPU a batch that holds such a row can land in a
  bigger padded bucket (the same tokens wherever the step's kernels give a row the same result in any batch, as
  they do on CPU; a kernel that does not could move a near-tie). Counters:
  ``pipelined_steps`` counts the decode steps fed on the device by the step before, ``discarded_tokens`` the
  tokens dropped for rows that had ended; ``decode_forwards`` and ``graph_decode_forwards`` count every forward
  that ran, discarded rows included.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from itertools import chain
from typing import Any

import torch

from kimi_linear.model.paged import greedy_ids

from .cache_manager import CacheManager
from .config import EngineConfig
from .model_runner import ModelRunner, PromptScores
from .pipeline import InFlight
from .sampling import SamplingError, SamplingParams, sample, token_logprobs
from .scheduler import Scheduler, StepPlan
from .sequence import RequestOutput, Sequence, Status

log = logging.getLogger("kimi_linear.engine")


class LLMEngine:
    """Synchronous engine; drive it with :meth:`step` (the server runs it in a background thread)."""

    def __init__(self, model: Any, config: EngineConfig | None = None, tokenizer: Any = None) -> None:
        self.model = model.eval()
        self.device = model.device
        self.cfg = (config or EngineConfig()).resolved(self.device.type)
        self.tokenizer = tokenizer
        mc = model.config
        self.max_context = int(mc.max_position_embeddings)
        self.vocab_size = int(mc.vocab_size)
        eos = mc.eos_token_id
        self.eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        paged = bool(self.cfg.cuda_graphs)
        self.cache = CacheManager(model, self.cfg, paged=paged)
        self.scheduler = Scheduler(self.cfg, self.cache, self.cfg.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.cache, graphs=paged, capture=paged and self.device.type == "cuda")
        self.by_id: dict[str, Sequence] = {}
        self.scoring: deque[Sequence] = deque()       # requests whose prompts are still to be scored
        self._counters = dict(prompt_tokens=0, generation_tokens=0, prefill_tokens=0, prefix_cache_hit_tokens=0,
                             prefix_cache_queries=0, prefix_cache_hits=0, requests_finished=0,
                             requests_aborted=0, steps=0, decode_forwards=0, prefill_forwards=0,
                             scored_tokens=0, score_forwards=0, pipelined_steps=0, discarded_tokens=0)
        self._inflight: InFlight | None = None          # the pipelined decode step not read back yet
        self._recent: deque[tuple[float, int]] = deque()        # (time, tokens) for tokens/s

    # The parts' state under the names the engine has always shown (tests, benchmarks, the server's metrics).
    slots = property(lambda self: self.cache.slots)
    blocks = property(lambda self: self.cache.blocks)
    snapshots = property(lambda self: self.cache.snapshots)
    graphs = property(lambda self: self.runner.graphs)
    running = property(lambda self: self.scheduler.running)
    waiting = property(lambda self: self.scheduler.waiting)

    @property
    def counters(self) -> dict[str, int]:
        """Running totals since start (a snapshot): tokens, prefix-cache hits, requests, forwards, preemptions."""
        return dict(self._counters, preemptions=self.scheduler.preemptions,
                    graph_decode_forwards=self.runner.graph_forwards)

    def _count_admitted(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self._counters["prefix_cache_queries"] += 1
            self._counters["prefix_cache_hits"] += seq.num_computed > 0
            self._counters["prefix_cache_hit_tokens"] += seq.num_computed

    # ------------------------------------------------------------------------------------------- bookkeeping
    def allocated_bytes(self) -> dict[str, int]:
        """Bytes the pools hold: KDA state slots, KDA prefix snapshots, MLA latent blocks (and, with the
        fixed-shape decode step, the padding rows' scratch slot and block and the device block table)."""
        return self.cache.allocated_bytes()

    def capture_cuda_graphs(self) -> int:
        """Capture the decode graphs of every batch bucket now instead of on first use (a server does this at
        start-up). Returns how many graphs are held (0 without CUDA graphs)."""
        return self.runner.capture_all()

    def token_capacity(self) -> int:
        return self.cache.token_capacity()

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
        self._counters["prompt_tokens"] += len(prompt_ids)
        if params.prompt_logprobs is not None:
            self.by_id[request_id] = seq
            self.scoring.append(seq)
            return seq
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
        self._counters["requests_aborted"] += 1
        self._finish(seq, "abort", emit=True)
        if self._inflight is not None and not self._inflight.live_rows():
            self._drain()               # nothing of the step in flight is wanted any more: do not leave it behind
        return True

    def has_work(self) -> bool:
        """Requests to run, or a pipelined decode step in flight (so ``while has_work(): step()`` reads it back)."""
        return bool(self.waiting or self.running or self.scoring or self._inflight is not None)

    def unfinished(self) -> list[Sequence]:
        """Every request not finished yet: running, waiting for a slot, waiting to be scored."""
        return list(chain(self.running, self.waiting, self.scoring))

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1.0) if self._recent else 1.0
        return dict(
            running=len(self.running), waiting=len(self.waiting) + len(self.scoring),
            kda_slots_used=self.slots.num_slots - len(self.slots.free), kda_slots_total=self.slots.num_slots,
            kda_snapshots_used=len(self.snapshots.slot_of), kda_snapshots_total=self.snapshots.pool.num_slots,
            mla_blocks_used=self.blocks.num_used(), mla_blocks_cached_free=len(self.blocks.free_cached),
            mla_blocks_total=self.blocks.num_blocks,
            generation_tokens_per_s=sum(n for _, n in self._recent) / span,
            **self.counters,
        )

    def _finish(self, seq: Sequence, reason: str, emit: bool) -> None:
        if seq.status == Status.FINISHED:
            return
        self.cache.release(seq)
        self.scheduler.remove(seq)
        if seq in self.scoring:
            self.scoring.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.by_id.pop(seq.request_id, None)
        if reason != "abort":
            self._counters["requests_finished"] += 1
        if emit:
            text, _ = seq.detok.update(seq.output_ids, True) if reason != "abort" else ("", False)
            self._emit(seq, text)

    def _emit(self, seq: Sequence, text: str) -> None:
        final = seq.status == Status.FINISHED
        out = RequestOutput(
            request_id=seq.request_id, token_ids=seq.pending, text=text, finished=final,
            finish_reason=seq.finish_reason if final else None, logprobs=seq.pending_lp,
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens,
            error=seq.error if final else None, prompt_logprobs=seq.prompt_lp,
        )
        seq.pending, seq.pending_lp, seq.prompt_lp = [], [], None
        if seq.on_output is not None:
            seq.on_output(out)

    def _advance(self, seqs: list[Sequence], T: int) -> None:
        """Count ``T`` more computed tokens per sequence (after their state and latents are in the pools)."""
        for s in seqs:
            # Prompt (or recomputed) tokens count as prefill even when the last one rides in a decode batch.
            self._counters["prefill_tokens"] += max(0, min(s.num_computed + T, s.prefill_target) - s.num_computed)
            s.num_computed += T

    def _after_forward(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Sample when the sequence has caught up with its tokens; check stop conditions; emit. ``greedy``: the
        argmax of ``logits`` when already known (a GPU batch computes all of them with one read-back)."""
        if seq.num_computed < seq.num_tokens():
            return
        self._sample_and_emit(seq, logits, greedy)

    def _sample_and_emit(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """Sample the next token from ``logits`` [vocab], check stop conditions, emit."""
        p = seq.params
        if greedy is not None and greedy < 0:
            raise SamplingError("the model produced NaN logits")
        if logits.device.type != "cpu" and (greedy is None or not p.is_greedy() or p.logprobs is not None):
            logits = logits.cpu()        # the request's generator lives on the CPU; log-probs read many values
        tok = greedy if greedy is not None and p.is_greedy() else sample(logits, p, seq.generator)
        entry = None
        if p.logprobs is not None:
            lp, alts = token_logprobs(logits, tok, p.logprobs)
            entry = (tok, lp, alts)
        self._emit_token(seq, tok, entry)

    def _emit_token(self, seq: Sequence, tok: int, lp: tuple | None = None) -> None:
        """Append a new token (``lp``: its log-prob entry, when the request asks for them), check stop
        conditions, emit."""
        seq.output_ids.append(tok)
        seq.pending.append(tok)
        if lp is not None:
            seq.pending_lp.append(lp)
        self._counters["generation_tokens"] += 1
        self._recent.append((time.monotonic(), 1))
        reason = None
        if tok in seq.stop_ids:
            reason = "stop"
        elif self._length_reached(seq):
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

    # ------------------------------------------------------------------------------------ per-request isolation
    def _after_forward_isolated(self, seq: Sequence, logits: torch.Tensor, greedy: int | None = None) -> None:
        """:meth:`_after_forward` for one row of a batch: a failure in this request's own sampling, stop checks,
        detokenization or output callback (NaN logits, a tokenizer error, ...) ends this request alone with
        ``finish_reason="error"``; the other rows of the batch go on exactly as they would have."""
        try:
            self._after_forward(seq, logits, greedy)
        except Exception as e:
            self.fail_request(seq, e)

    def fail_request(self, seq: Sequence, err: BaseException | str) -> None:
        """End ``seq`` with ``finish_reason="error"`` and ``err`` as its message, freeing its slot and blocks.
        Touches nothing that could fail again for this request (no detokenization; a failing output callback is
        logged). Also what the background thread uses when a whole step fails."""
        msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        if not isinstance(err, str):
            log.warning("request %s failed: %s", seq.request_id, msg, exc_info=not isinstance(err, SamplingError))
        seq.error = msg[:500]
        if seq.status != Status.FINISHED:
            self._finish(seq, "error", emit=False)
        try:
            self._emit(seq, "")
        except Exception:
            log.exception("request %s: its output callback failed", seq.request_id)

    @staticmethod
    def _greedy_readback(logits: torch.Tensor) -> list[int | None]:
        """Every row's argmax in one device read-back (GPU), -1 for a row with NaN logits; [None] * B on a CPU
        (there rows are sampled one by one, which checks them)."""
        if logits.device.type == "cpu":
            return [None] * logits.shape[0]
        return greedy_ids(logits).tolist()

    # ---------------------------------------------------------------------------------------------------- step
    def step(self) -> None:
        """One scheduling round: plan (admit, reserve), one batched decode forward, the prompt chunks; then sample
        and emit for every sequence that caught up with its tokens. A pipelined round (see the module docstring)
        launches the next decode step and then emits the tokens of the one before; any other round first reads
        back and emits the step in flight."""
        self._counters["steps"] += 1
        if not self._pipelined_step():
            self._drain()
            self._serial_step()
        if not self.running and self.waiting:
            self._count_admitted(self.scheduler.admit())    # the step may have finished every running sequence
            if not self.running:
                # Nothing runs and the head could not be admitted with every block free: the pool is too small
                # for it (check_request rules this out); fail it rather than spin.
                self._finish(self.waiting[0], "error", emit=True)

    def _serial_step(self) -> None:
        """Score prompts, plan, run the step's forwards and emit their tokens, all before returning."""
        if self.scoring:
            self._score_step()
        plan = self.scheduler.plan()
        self._count_admitted(plan.admitted)
        if plan.prefill and self.cfg.mixed_steps:
            self._mixed_step(plan)
        else:
            self._separate_step(plan)

    def _separate_step(self, plan: StepPlan) -> None:
        """Decode rows in one forward (the CUDA-graph step when there is one), then the prompt chunks batched by
        length."""
        if plan.decode:
            self._counters["decode_forwards"] += 1
            logits, in_graph = self.runner.decode(plan.decode)
            self._advance(plan.decode, 1)
            # On a GPU, one read-back for every greedy row instead of one per row (computed inside the graph).
            greedy = in_graph.tolist() if in_graph is not None else self._greedy_readback(logits)
            for r, s in enumerate(plan.decode):
                self._after_forward_isolated(s, logits[r], greedy[r])
        if plan.prefill:
            self._counters["prefill_forwards"] += len({T for _, T in plan.prefill})
            rows = [(s, T, logits) for (s, T), (_, logits) in zip(plan.prefill, self.runner.prefill(plan.prefill))]
            for s, T, _ in rows:
                self._advance([s], T)
                self.cache.register_blocks(s, snapshot=True)
            # The rows that reached their prompt's end sample now: their argmaxes in one read-back, as a decode
            # batch's (a copy of each row's logits to the host and a CPU argmax cost ~1 ms a row on a GPU).
            done = [(s, logits) for s, _, logits in rows if s.num_computed >= s.num_tokens()]
            greedy = self._greedy_readback(torch.stack([lg for _, lg in done])) if done else []
            for (s, logits), g in zip(done, greedy):
                self._after_forward_isolated(s, logits, g)

    def _mixed_step(self, plan: StepPlan) -> None:
        """Decode rows and prompt chunks as one packed forward (``EngineConfig.mixed_steps``)."""
        work = [(s, 1) for s in plan.decode] + plan.prefill
        self._counters["decode_forwards"] += bool(plan.decode)
        self._counters["prefill_forwards"] += 1
        out = self.runner.mixed(work)
        logits = torch.stack([lg for _, lg in out])
        greedy = self._greedy_readback(logits)
        for r, (s, T) in enumerate(work):
            self._advance([s], T)
            if r >= len(plan.decode):
                self.cache.register_blocks(s, snapshot=True)
            self._after_forward_isolated(s, logits[r], greedy[r])

    # -------------------------------------------------------------------------------------- pipelined decode
    def _pipelined_step(self) -> bool:
        """Launch the next greedy decode step (fed on the device by the step in flight, if any), then emit the step
        in flight's tokens while the new one runs. False when this round cannot be pipelined: nothing was done."""
        rows = self._pipeline_rows()
        if not rows:
            return False
        prev = self._inflight
        for s in rows:
            grown = self.cache.grow(s, s.num_computed + 1)          # free blocks were counted: no preemption
            assert grown
        greedy = self.runner.launch_decode(rows, prev.ids_for(rows) if prev is not None else None)
        if greedy is None:
            return False                                            # no fixed-shape step after all: run serially
        self._counters["decode_forwards"] += 1
        self._counters["pipelined_steps"] += prev is not None
        self._advance(rows, 1)
        self._inflight = InFlight.launched(rows, greedy)
        if prev is not None:
            self._emit_step(prev)
        # No row can go on into a next pipelined step: read this one back now (an output callback may already
        # have, by aborting every row in flight).
        if self._inflight is not None and not self._continuing(self._inflight):
            self._drain()
        return True

    def _pipeline_rows(self) -> list[Sequence] | None:
        """The rows of the next pipelined decode step, or None when the next round must run serially: pipelining
        is off or the fixed-shape step is gone, a prompt waits to be scored or could be admitted (or will be, when a
        row of the step in flight ends by length), a running sequence is not decoding (a prompt chunk) or not greedy
        or asks for log-probs, or a row would need a block that is not plainly free (taking it could preempt, or
        evict a cached prefix block)."""
        graphs = self.runner.graphs
        if not self.cfg.pipeline_decode or graphs is None or graphs.broken is not None:
            return None
        if self.scoring or self._may_admit():
            return None
        prev = self._inflight
        if prev is None:
            rows = list(self.running)
            if any(s.num_tokens() - s.num_computed != 1 for s in rows):
                return None
        else:
            # Every running sequence must be a live row of the step in flight (nothing was admitted since).
            live = prev.live_rows()
            if len(live) != len(self.running):
                return None
            rows = self._continuing(prev)
            if self.waiting and len(rows) < len(live):
                return None             # a row ends by length and frees its slot: admit now, as a serial step would
        if not all(s.params.is_greedy() and s.params.logprobs is None for s in rows):
            return None
        need = sum(self.cache.blocks_short(s, s.num_computed + 1) for s in rows)
        return rows if need <= len(self.blocks.free_plain) else None

    def _may_admit(self) -> bool:
        """Whether the scheduler might admit a waiting request now (a free slot, admission not held)."""
        return bool(self.waiting and self.slots.free and not (self.running and self.scheduler.hold_admission))

    def _continuing(self, step: InFlight) -> list[Sequence]:
        """The live rows of ``step`` that go on after it: all but those whose token from it will end them by
        length (known in advance; an EOS or stop is not, and costs that row one discarded token)."""
        return [s for s in step.live_rows() if not self._length_reached(s, pending=1)]

    def _length_reached(self, seq: Sequence, pending: int = 0) -> bool:
        """Whether ``seq`` ends by length once ``pending`` more tokens (in flight, not appended yet) are its own:
        ``max_tokens`` output tokens, or the model's context."""
        return (len(seq.output_ids) + pending >= seq.max_tokens
                or seq.num_tokens() + pending >= self.max_context)

    def _drain(self) -> None:
        """Read back and emit the step in flight, if any."""
        step, self._inflight = self._inflight, None
        if step is not None:
            self._emit_step(step)

    def _emit_step(self, step: InFlight) -> None:
        """Emit each live row's token of a pipelined step (what :meth:`_after_forward` does for a greedy row);
        rows that finished after its launch drop theirs (their slot and blocks are already released: any later
        use of them is queued on the device after this step)."""
        for r, (s, tok) in enumerate(zip(step.rows, step.tokens())):
            if not step.is_live(r):
                self._counters["discarded_tokens"] += 1
                continue
            try:
                if tok < 0:
                    raise SamplingError("the model produced NaN logits")
                self._emit_token(s, tok)
            except Exception as e:
                self.fail_request(s, e)

    # ---------------------------------------------------------------------------------------------- scoring
    def _score_step(self) -> None:
        """Score the prompts at the head of the scoring queue (at least one; more while they fit
        ``max_num_scored_tokens``) in one forward; then each request gets its first token (see the module
        docstring). A failure fails these requests alone."""
        batch, size = [], 0
        while self.scoring and (not batch or size + len(self.scoring[0].prompt_ids) <= self.cfg.max_num_scored_tokens):
            batch.append(self.scoring.popleft())
            size += len(batch[-1].prompt_ids)
        self._counters["score_forwards"] += 1
        self._counters["scored_tokens"] += size
        try:
            scores = self.runner.score(batch, max(s.params.prompt_logprobs or 0 for s in batch))
        except Exception as e:
            for s in batch:
                self.fail_request(s, e)
            return
        for s, sc in zip(batch, scores):
            try:
                self._scored(s, sc)
            except Exception as e:
                self.fail_request(s, e)

    def _scored(self, seq: Sequence, sc: PromptScores) -> None:
        k = seq.params.prompt_logprobs or 0
        ids, lps = sc.top_ids[:, :k].tolist(), sc.top_logprobs[:, :k].tolist()
        seq.prompt_lp = [None] + [(t, lp, list(zip(a, b)))
                                  for t, lp, a, b in zip(seq.prompt_ids[1:], sc.logprobs.tolist(), ids, lps)]
        if seq.max_tokens == 0:
            self._finish(seq, "length", emit=True)
            return
        self._sample_and_emit(seq, sc.last_logits)
        if seq.status != Status.FINISHED:
            # Prompt and first token go through the pools like a preempted sequence's (recomputed, then decoded).
            self.waiting.append(seq)
