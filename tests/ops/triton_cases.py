"""Shared by the Triton interpreter tests: NaN-poisoned allocations and the float64 reference after the in-kernel
transforms."""

import pytest
import torch

from kimi_linear.ops import naive_recurrent_kda
from kimi_linear.ops.gate import KernelOptions

NAN = float("nan")
_DEFAULT = object()


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """torch.empty / torch.empty_like / Tensor.new_empty hand out NaN-filled memory while a test runs, so an output
    element (or an intermediate buffer) a kernel forgets to write shows up as NaN."""
    real_empty, real_empty_like, real_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    poison = lambda x: x.fill_(NAN) if x.is_floating_point() else x
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: poison(real_new_empty(self, *a, **kw)))


def reference(x, opts: KernelOptions, cu_seqlens=None, initial_state=_DEFAULT):
    """The float64 ground truth after the in-kernel transforms, applied in float64; the initial state defaults to
    ``x["initial_state"]``."""
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    q, k, g, beta = opts.apply(d["q"], d["k"], d["g"], d["beta"])
    h0 = x["initial_state"] if initial_state is _DEFAULT else initial_state
    return naive_recurrent_kda(q.double(), k.double(), d["v"], g.double(), beta.double(),
                               initial_state=h0, output_final_state=True, cu_seqlens=cu_seqlens)


def reference_grads(x, opts: KernelOptions, weights, cu_seqlens=None, params=None):
    """Gradients of ``sum(o * w_o) + sum(S_final * w_S)`` through the float64 reference (the in-kernel transforms
    applied differentiably in float64) for every tensor of ``x`` and ``params`` (A_log, dt_bias): a dict of float64
    gradients (None for absent tensors)."""
    leaves = {n: (None if t is None else t.detach().double().requires_grad_())
              for n, t in dict(x, **(params or {})).items()}
    if opts.use_gate_in_kernel:
        opts = KernelOptions(opts.use_qk_l2norm_in_kernel, True, opts.use_beta_sigmoid_in_kernel,
                             opts.allow_neg_eigval, leaves["A_log"], leaves.get("dt_bias"), opts.lower_bound)
    q, k, g, beta = opts.apply(leaves["q"], leaves["k"], leaves["g"], leaves["beta"])
    o, S = naive_recurrent_kda(q.double(), k.double(), leaves["v"], g.double(), beta.double(),
                               initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu_seqlens)
    w_o, w_S = weights
    ((o * w_o).sum() + (S * w_S).sum()).backward()
    return {n: (None if t is None else t.grad) for n, t in leaves.items()}
