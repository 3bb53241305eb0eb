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


def strong_gate(HV, K, seed=0):
    """The in-kernel softplus gate in the strong-decay regime of issue 20: ``A_log = log U(1, 16)`` and
    ``dt_bias ~ 0.1 N(0, 1)``, so that raw gates ~ N(0, 1) decay by about 6.7 a step on average (a 16-row
    sub-block by about 107, past SAFE_EXP = 60: the diagonal blocks take the reference-row levels). Returns the
    kernel options (l2norm, beta sigmoid) and the parameters as a dict for the gradient checks."""
    gen = torch.Generator().manual_seed(seed)
    params = dict(A_log=torch.empty(HV).uniform_(1, 16, generator=gen).log(),
                  dt_bias=0.1 * torch.randn(HV * K, generator=gen))
    return KernelOptions(True, True, True, False, params["A_log"], params["dt_bias"], None), params


def mixed_gates(x, seed=0, group=None):
    """Log decays (not raw) mixing mild and strong channels inside each chunk: in groups of ``group`` channels
    (default K / 2), mild ones falling by about 0.3 a step, then strong ones by about 7 (every 16-row sub-block by
    about 112), alternating; every 9th step is -1000 on the strong channels (padding-like). With K = 64 and 32
    channels a step, the scores and their gradients see a channel step on the fast diagonal product beside one on
    the reference-row levels in the same chunk; groups of 16 put both kinds inside one 32-channel step."""
    g = x["g"].double()
    K = g.shape[-1]
    strong = (torch.arange(K) // (group or K // 2)) % 2 == 1                       # [K]
    noise = torch.randn(g.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = torch.where(strong, (-7.0 + noise).clamp_max(0.0), -0.3 + 0.05 * noise)
    g[:, ::9] = torch.where(strong, -1000.0, g[:, ::9])
    x["g"] = g.to(x["g"].dtype)
    return x


def stepped_gates(x, steps, seed):
    """Log decays of value head h about ``steps[h]`` a step (plus 0.1 N(0, 1) noise, the same draw for every head),
    e.g. (-0.5, -3, -6): one head per score path (separable, bounded per sub-block, neither)."""
    g = x["g"].double()
    B, T, _, K = g.shape
    noise = 0.1 * torch.randn(B, T, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for hv, step in enumerate(steps):
        g[:, :, hv] = step + noise
    x["g"] = g.to(x["g"].dtype)
    return x


def spy_calls(monkeypatch, module, name):
    """Count the calls of the device function ``module.name`` (under the interpreter a kernel looks its callees up
    in its module's globals when it runs, so a wrapper there sees every call)."""
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def force_levels(monkeypatch):
    """Send every diagonal block of the score gradients' sub-block scheme through the reference-row levels (bf16:
    the clamped gate steps), mild gates included: the fast ``exp(gP_i) exp(-gP_j)`` path is taken only below
    SAFE_EXP, which -1 never is. (The forward's blocked chunks take the diagonal pass at any gate.)"""
    import triton.language as tl

    from kimi_linear.ops.triton import chunk_bwd

    monkeypatch.setattr(chunk_bwd, "SAFE_EXP", tl.constexpr(-1.0))


def spy_tiles(monkeypatch):
    """Record each chunk_wy.chunk_tile call as (channel step, whether through a descriptor), in call order."""
    from kimi_linear.ops.triton import chunk_wy

    tiles = []
    real = chunk_wy.chunk_tile
    monkeypatch.setattr(chunk_wy, "chunk_tile", lambda *a: tiles.append((a[-3], bool(a[-1]))) or real(*a))
    return tiles
