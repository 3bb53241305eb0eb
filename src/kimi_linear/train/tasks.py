"""Synthetic tasks of the Kimi Linear report, generated on the fly: MQAR, Palindrome and Stack.

A task's ``batch(B, T, gen)`` returns ``(input_ids, labels)`` of shape [B, T] (int64); ``labels[b, t]`` is the
token the model must predict *at* position t (already shifted), or -100 where nothing is scored. Batches are a pure
function of the generator's seed, so training resumes exactly and held-out sets never overlap training.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

IGNORE = -100


def _randint(n: int, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, n, shape, generator=gen)


@dataclass(frozen=True)
class MQAR:
    """Multi-query associative recall (Zoology's MQAR layout): N key-value pairs ``k1 v1 ... kN vN``, then the rest
    of the row is noise into which every key is asked once, as a ``k v`` pair at a random pair-aligned slot (so the
    queries come in a random order and at every distance from the context, up to the row's length); the model
    answers each query key with its value. Ids: keys ``[0, num_keys)``, values next, noise last.
    N = min(max_pairs, num_keys, T // 8), so at least half of the row after the context is noise.

    Why scattered rather than all queries at the end: with every query behind a gap of T - 4N noise tokens, a
    freshly initialised KDA / Gated DeltaNet / attention model gets no usable gradient (its forget gates start
    leaky, so a far recall is invisible) and stays at chance for hundreds of steps at any length (the first GPU
    grid: all nine MQAR cells at 1/256 after 400-650 steps). Near queries make recall learnable first; far ones
    still measure how long the memory holds, which is what the length axis compares."""

    num_keys: int = 256
    num_values: int = 256
    num_noise: int = 64
    max_pairs: int = 64
    name: str = "mqar"

    @property
    def vocab_size(self) -> int:
        return self.num_keys + self.num_values + self.num_noise

    @property
    def chance(self) -> float:
        return 1 / self.num_values

    def batch(self, B: int, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        N = min(self.max_pairs, self.num_keys, T // 8)
        if N < 1:
            raise ValueError(f"MQAR needs seq_len >= 8, got {T}")
        keys = torch.rand(B, self.num_keys, generator=gen).argsort(-1)[:, :N]     # distinct keys per row
        values = self.num_keys + _randint(self.num_values, (B, N), gen)
        context = torch.stack([keys, values], -1).flatten(1)                     # k1 v1 k2 v2 ...
        rest = self.num_keys + self.num_values + _randint(self.num_noise, (B, T - 2 * N), gen)
        ids = torch.cat([context, rest], 1)
        slots = torch.rand(B, (T - 2 * N) // 2, generator=gen).argsort(-1)[:, :N]  # distinct slots, random order
        at = 2 * N + 2 * slots                                                    # where key i is asked
        ids.scatter_(1, at, keys)
        ids.scatter_(1, at + 1, values)
        labels = torch.full_like(ids, IGNORE)
        labels.scatter_(1, at, values)                                            # predicted at the query key
        return ids, labels


@dataclass(frozen=True)
class Palindrome:
    """A random string over ``alphabet`` tokens, a separator, then the string reversed; scored on the reversal."""

    alphabet: int = 64
    name: str = "palindrome"

    @property
    def vocab_size(self) -> int:
        return self.alphabet + 1

    @property
    def chance(self) -> float:
        return 1 / self.alphabet

    def batch(self, B: int, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        L = (T - 1) // 2
        if L < 1:
            raise ValueError(f"Palindrome needs seq_len >= 3, got {T}")
        sep = self.alphabet
        s = _randint(self.alphabet, (B, L), gen)
        ids = torch.cat([s, torch.full((B, 1), sep), s.flip(1), torch.full((B, T - 2 * L - 1), sep)], 1)
        labels = torch.full_like(ids, IGNORE)
        labels[:, L:2 * L] = ids[:, L + 1:2 * L + 1]                              # from the separator on
        return ids, labels


@dataclass(frozen=True)
class Stack:
    """Random ``PUSH s x`` and ``POP s x`` over ``num_stacks`` stacks; scored on x after each POP (the top of
    stack s). Pops only name non-empty stacks; the tail is padded with PUSH tokens.
    Ids: stacks ``[0, num_stacks)``, values next, then PUSH and POP."""

    num_stacks: int = 64
    num_values: int = 128
    name: str = "stack"

    @property
    def vocab_size(self) -> int:
        return self.num_stacks + self.num_values + 2

    @property
    def chance(self) -> float:
        return 1 / self.num_values

    def batch(self, B: int, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        push, pop = self.num_stacks + self.num_values, self.num_stacks + self.num_values + 1
        n_ops = T // 3
        coin = torch.rand(B, n_ops, generator=gen).tolist()
        pick = _randint(self.num_stacks, (B, n_ops), gen).tolist()
        vals = (self.num_stacks + _randint(self.num_values, (B, n_ops), gen)).tolist()
        ids = [[push] * T for _ in range(B)]
        labels = [[IGNORE] * T for _ in range(B)]
        for b in range(B):
            row, lab = ids[b], labels[b]
            stacks: list[list[int]] = [[] for _ in range(self.num_stacks)]
            nonempty: list[int] = []                 # indices of non-empty stacks, kept sorted
            for i in range(n_ops):
                if nonempty and coin[b][i] < 0.5:
                    s = nonempty[pick[b][i] % len(nonempty)]
                    x = stacks[s].pop()
                    if not stacks[s]:
                        nonempty.remove(s)
                    row[3 * i:3 * i + 3] = (pop, s, x)
                    lab[3 * i + 1] = x
                else:
                    s, x = pick[b][i], vals[b][i]
                    if not stacks[s]:
                        bisect.insort(nonempty, s)
                    stacks[s].append(x)
                    row[3 * i:3 * i + 3] = (push, s, x)
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(labels, dtype=torch.int64)


Task = MQAR | Palindrome | Stack
TASKS: dict[str, type] = {"mqar": MQAR, "palindrome": Palindrome, "stack": Stack}


def get_task(name: str, **sizes: int) -> Task:
    """A task by name, with optional size fields (e.g. ``get_task("mqar", num_keys=16, num_values=16)``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    return TASKS[name](**sizes)
