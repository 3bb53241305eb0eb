"""The engine's scheduler: admission (FIFO), preemption when the block pool runs dry, and each step's work under a
token budget.

A step runs every running sequence that has exactly one uncomputed token (decode rows, one token each), then prompt
chunks of sequences still reading their prompt, while the step's token budget lasts. Prompt chunks end at multiples
of ``prefill_chunk`` (the KDA snapshot granularity for prefix caching) and at the prompt's last full block.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .cache_manager import CacheManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class StepPlan:
    """What one step runs: ``decode`` rows (one token each) and ``prefill`` (sequence, tokens) chunks."""

    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)     # admitted for the first time this step


class Scheduler:
    """Waiting queue, running list, admission, preemption, and the step plan (see the module docstring)."""

    def __init__(self, cfg: EngineConfig, cache: CacheManager, token_budget: int) -> None:
        self.cfg, self.cache = cfg, cache
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.hold_admission = False          # set by a preemption, cleared by a finish
        self.preemptions = 0

    # --------------------------------------------------------------------------------------------- admission
    def admit(self) -> list[Sequence]:
        """Admit from the head of the queue; returns the sequences admitted for the first time."""
        first: list[Sequence] = []
        while self.waiting and self.cache.slots.free:
            seq = self.waiting[0]
            shared, h = self.cache.match_prefix(seq)
            need, revived = self.cache.blocks_needed(seq, shared)
            free = self.cache.blocks.num_free()
            # Headroom of one block per running sequence, and no admission after a preemption until something
            # finishes: otherwise the victim is readmitted at once, recomputed, and preempted again (thrashing).
            if self.running and (self.hold_admission or need > free - revived - len(self.running)):
                break                                   # head of line waits for blocks (FIFO, no starvation)
            if need > free - revived:
                break
            self.waiting.popleft()
            self.cache.assign(seq, shared, h)
            seq.prefill_target = seq.num_tokens()       # tokens to (re)compute before decoding new ones
            if not seq.admitted_once:
                seq.cached_tokens = seq.num_computed
                seq.admitted_once = True
                first.append(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        return first

    def preempt(self, seq: Sequence) -> None:
        """Give back a running sequence's slot and blocks; it is recomputed from its tokens when readmitted."""
        self.preemptions += 1
        self.hold_admission = True
        self.cache.release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def reserve(self, seq: Sequence, upto: int) -> bool:
        """Blocks for tokens [0, upto); preempts the newest other running sequences if needed. False if ``seq``
        itself had to be preempted."""
        while not self.cache.grow(seq, upto):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def remove(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves the queues (its cache is released by the caller)."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.hold_admission = False

    # -------------------------------------------------------------------------------------------------- plan
    def plan(self) -> StepPlan:
        """Admit, then choose this step's decode rows and prompt chunks (blocks reserved for all of them)."""
        plan = StepPlan(admitted=self.admit())
        for s in [s for s in self.running if s.num_tokens() - s.num_computed == 1]:
            if s.status == Status.RUNNING and self.reserve(s, s.num_computed + 1):
                plan.decode.append(s)
        plan.decode = [s for s in plan.decode if s.status == Status.RUNNING]      # a later reserve may preempt
        budget = max(self.token_budget - len(plan.decode), 0)
        chunk, bs = self.cfg.prefill_chunk, self.cfg.block_size
        for s in [s for s in self.running if s.num_tokens() - s.num_computed > 1]:
            if budget <= 0 and plan.prefill:
                break
            if s.status != Status.RUNNING:
                continue
            p, n = s.num_computed, s.num_tokens()
            end = min((p // chunk + 1) * chunk, n)
            # Also stop at the prompt's last full block, so a later prompt that extends this one (the next turn
            # of a chat, a retry) finds a KDA snapshot there.
            last_full = n // bs * bs
            if self.cfg.prefix_caching and p < last_full < end:
                end = last_full
            T = end - p
            if T > budget and plan.prefill:
                break                                   # the first chunk always runs: prompts progress
            if not self.reserve(s, end):
                continue
            plan.prefill.append((s, T))
            budget -= T
        # A reserve for a later chunk may have preempted an earlier pick.
        plan.prefill = [(s, T) for s, T in plan.prefill if s.status == Status.RUNNING]
        plan.decode = [s for s in plan.decode if s.status == Status.RUNNING]
        return plan
