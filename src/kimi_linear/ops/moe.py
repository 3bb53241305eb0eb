"""Routed experts of a mixture-of-experts FFN as one operator (docs/model.md §5; K3's SiTU: §7).

Each token n chose k experts ``topk_ids[n]`` with routing weights ``topk_weights[n]``; expert e is the GLU feed-forward

    expert_e(x) = w2[e] @ glu(w1[e] @ x, w3[e] @ x)          w13[e] = [w1[e]; w3[e]]  [2I, W],  w2[e]  [W, I]

and the output is ``out[n] = sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n]) + sum_s expert_{E+s}(x[n])``:
the last ``num_shared`` matrices of the stacks are shared experts, which every token runs with weight 1 (Kimi
Linear's one shared expert of the routed experts' width rides along as one more pair per token instead of three
more kernels and an add).

The router before it (:func:`sigmoid_topk`): ``s = sigmoid(logits)``, the top-k of ``s + bias`` (a load-balancing
offset that picks but does not weigh), weights ``s`` at those experts, optionally renormalised to sum 1, times a
scaling factor.

``glu`` is SiLU-GLU ``silu(gate) * up`` (Kimi Linear) or SiTU (Kimi K3, ``layers.activation.SiTUGLU``):
``beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta)``.

On CUDA tensors :func:`fused_moe` runs the Triton kernels of :mod:`kimi_linear.ops.triton.moe` (grouped GEMMs over
the tokens sorted by expert, capturable in a CUDA graph); this module is the PyTorch path (sort, then one pair of
matmuls per expert; it reads the routing on the host) and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import for_inference, triton_op

ACTIVATIONS = ("silu", "situ")


def check_fused_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, activation: str, situ_beta: float,
                           situ_linear_beta: float, num_shared: int = 0) -> None:
    """Shapes, dtypes and devices of :func:`fused_moe`'s arguments; a ValueError names the one that is off. The
    values of ``topk_ids`` are not checked (that would read them on the host)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"fused_moe: x must be a floating tensor [N, W], got {x.dtype} {tuple(x.shape)}")
    N, W = x.shape
    if w13.dim() != 3 or w13.shape[2] != W or w13.shape[1] % 2 or w13.shape[1] == 0:
        raise ValueError(f"fused_moe: w13 must be [E, 2I, W={W}] (gate rows, then up rows), got {tuple(w13.shape)}")
    E, I = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, W, I):
        raise ValueError(f"fused_moe: w2 must be [E={E}, W={W}, I={I}], got {tuple(w2.shape)}")
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != x.dtype:
            raise ValueError(f"fused_moe: {name} must have x's dtype {x.dtype}, got {t.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != N or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be an int32/int64 tensor [N={N}, k], got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if not (isinstance(num_shared, int) and 0 <= num_shared < E):
        raise ValueError(f"fused_moe: num_shared must be an int in [0, {E}) (the last stacked experts), "
                         f"got {num_shared!r}")
    E -= num_shared
    k = topk_ids.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"fused_moe: topk_ids must choose 1 <= k <= E={E} routed experts per token, got k={k}")
    if tuple(topk_weights.shape) != (N, k) or not topk_weights.is_floating_point():
        raise ValueError(f"fused_moe: topk_weights must be a floating tensor [N={N}, k={k}], got "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"fused_moe: {name} is on {t.device}, x on {x.device}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, b in (("situ_beta", situ_beta), ("situ_linear_beta", situ_linear_beta)):
        if not b > 0:
            raise ValueError(f"fused_moe: {name} must be > 0, got {b}")


def glu_torch(gate: torch.Tensor, up: torch.Tensor, activation: str, situ_beta: float = 4.0,
              situ_linear_beta: float = 25.0) -> torch.Tensor:
    """The GLU of the layers, in their arithmetic: ``silu(gate) * up`` in the input dtype, or SiTU in float32
    (float64 for float64 inputs) cast back (as ``layers.activation.SiTUGLU``)."""
    if activation == "silu":
        return F.silu(gate) * up
    g = gate if gate.dtype in (torch.float32, torch.float64) else gate.float()
    u = up if up.dtype in (torch.float32, torch.float64) else up.float()
    g = situ_beta * torch.tanh(g / situ_beta) * torch.sigmoid(g)
    u = situ_linear_beta * torch.tanh(u / situ_linear_beta)
    return (g * u).to(gate.dtype)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 4.0,
                    situ_linear_beta: float = 25.0, num_shared: int = 0,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fused_moe` in PyTorch: the (token, expert) pairs sorted by expert, then per expert with tokens its
    two matmuls in x's dtype (the layers' arithmetic); the weighted outputs are summed in float32 (float64 for
    float64 inputs), the shared experts' after the routed ones. Reads the per-expert counts on the host."""
    N, W = x.shape
    E, k = w13.shape[0] - num_shared, topk_ids.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(N, W, dtype=acc, device=x.device)
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    token_of = order // k
    w_sorted = topk_weights.reshape(-1)[order].to(acc)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)                                 # [n, I] each
        y = F.linear(glu_torch(gate, up, activation, situ_beta, situ_linear_beta), w2[e])    # [n, W]
        out.index_add_(0, tok, y.to(acc) * w_sorted[start : start + n, None])
        start += n
    for e in range(E, E + num_shared):
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        out += F.linear(glu_torch(gate, up, activation, situ_beta, situ_linear_beta), w2[e]).to(acc)
    if residual is not None:
        out += residual.to(acc)
    return out.to(x.dtype)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 4.0,
              situ_linear_beta: float = 25.0, num_shared: int = 0,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum (module docstring), plus ``residual`` [N, W] when given (added to the
    float32 sum before the one rounding to x's dtype: a decoder layer's residual add, without its own kernel).
    Inference only (no autograd).

    x: [N, W]; w13: [E + S, 2I, W], rows 0..I-1 the gate projection w1, rows I..2I-1 the up projection w3; w2:
    [E + S, W, I] (all one dtype: float32, bfloat16, float16, or float64 on the PyTorch path); the last
    S = ``num_shared`` experts are shared (every token, weight 1); topk_weights: [N, k] (used in float32);
    topk_ids: [N, k] int32/int64, each in [0, E) (the Triton path ignores a pair whose id is outside, the PyTorch
    path raises). activation: ``"silu"`` or ``"situ"`` with ``situ_beta`` (b), ``situ_linear_beta``
    (b_lin). Products accumulate in float32; the hidden ``glu(...)`` is rounded to x's dtype before the down
    projection, as in the layers. Returns [N, W] in x's dtype.
    """
    check_fused_moe_inputs(x, w13, w2, topk_weights, topk_ids, activation, situ_beta, situ_linear_beta, num_shared)
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype
                                 or residual.device != x.device):
        raise ValueError(f"fused_moe: residual must be x's shape {tuple(x.shape)}, dtype and device, got "
                         f"{residual.dtype} {tuple(residual.shape)} on {residual.device}")
    fast = triton_op("fused_moe", x) if x.dtype != torch.float64 else None
    if fast is None:
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids, activation, situ_beta, situ_linear_beta,
                               num_shared, residual)
    return fast(x, w13, w2, topk_weights, topk_ids, activation, situ_beta, situ_linear_beta, num_shared=num_shared,
                residual=residual)


def fused_moe_available(x: torch.Tensor) -> bool:
    """Whether :func:`fused_moe` on ``x`` runs the Triton kernels (capture-safe, no host sync) rather than the
    PyTorch path."""
    return x.dtype != torch.float64 and triton_op("fused_moe", x) is not None


ROUTER_TRITON_MAX_TOKENS = 16    # small decode batches; more rows take cuBLAS, which reads W once per tile


def router_logits(x: torch.Tensor, weight: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """The router's logits ``x @ weight^T`` in float32 (float64 if either is float64) with x widened first: x [N, D]
    any float dtype, weight [E, D] float32 -> [N, E], also under autocast.

    On CUDA, without autograd and for up to ROUTER_TRITON_MAX_TOKENS rows, one Triton kernel that widens x as it
    reads it (instead of a cast kernel and cuBLAS's two-kernel float32 GEMV); each row's sums run in the same order
    whatever N is, so a token's routing does not depend on its batch. Else PyTorch.

    prefetch: a tensor on x's device that the step reads right after the routing whatever it is (the MoE layer
    passes its shared expert's stacked gate/up weights); the kernel asks it into L2 while the router and the top-k
    leave HBM idle. A hint only: no result depends on it, and the PyTorch path ignores it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"router_logits: x must be [N, D] and weight [E, D], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[0] <= ROUTER_TRITON_MAX_TOKENS and weight.dtype == torch.float32:
        fast = for_inference(triton_op("router_logits", x), x, weight)
        if fast is not None:
            return fast(x, weight, prefetch if prefetch is not None and prefetch.device == x.device else None)
    acc = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    # Under bf16 autocast (training on a GPU) F.linear would round the logits to bf16: near-ties between experts
    # would then be decided by rounding, and sigmoid_topk refuses 16-bit logits.
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.to(acc), weight.to(acc))


def sigmoid_topk_torch(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sigmoid_topk` in PyTorch (differentiable in ``logits``)."""
    scores = logits.sigmoid()
    idx = (scores + bias).topk(k, dim=-1)[1]
    w = scores.gather(1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True).add_(1e-20)
    return (w * scale if scale != 1.0 else w), idx


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sigmoid router's choice (module docstring): logits [N, E] float32 (or float64), bias [E] -> (weights
    [N, k] in logits' dtype, expert ids [N, k] int64), the k experts in decreasing ``sigmoid(logit) + bias``.

    On CUDA, when no gradient is needed, one Triton kernel (one program per token; on a GPU decode step the ~10
    PyTorch kernels of sigmoid, add, top-k, gather, sum, divide, scale cost more than the work); else PyTorch."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"sigmoid_topk: logits must be float32 or float64 [N, E], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    E = logits.shape[1]
    if tuple(bias.shape) != (E,) or not bias.is_floating_point():
        raise ValueError(f"sigmoid_topk: bias must be a floating tensor [E={E}], got {bias.dtype} {tuple(bias.shape)}")
    if not 1 <= k <= E:
        raise ValueError(f"sigmoid_topk: k must be in [1, E={E}], got {k}")
    fast = for_inference(triton_op("sigmoid_topk", logits), logits, bias, dtypes=(torch.float32,))
    if fast is None:
        return sigmoid_topk_torch(logits, bias, k, renormalize, scale)
    return fast(logits, bias, k, renormalize, scale)
