"""Kimi Delta Attention operators, with fla-core 0.6's names and arguments (``from fla.ops.kda import ...``), the
paged MLA decode attention (:mod:`.mla_decode`), and the model's other fused pieces (MoE and its router, the
residual stream's norms, a decode step's pool rows and its greedy tokens)."""

from .checks import KDAShape, check_kda_inputs
from .chunk import CHUNK_SIZE, chunk_gated_delta_rule, chunk_kda
from .conv import short_conv
from .gate import fused_kda_gate, l2norm
from .greedy import logits_and_greedy
from .mla_decode import paged_mla_decode
from .mla_heads import absorb_query, expand_values
from .moe import fused_moe, router_logits, sigmoid_topk
from .norm import gated_rms_norm
from .paged import paged_decode_rows
from .recurrent import fused_recurrent_kda
from .reference import naive_recurrent_kda
from .rms_norm import add_rms_norm, project_add_rms_norm, rms_norm_write  # rms_norm: ops.rms_norm.rms_norm

__all__ = [
    "CHUNK_SIZE",
    "KDAShape",
    "absorb_query",
    "add_rms_norm",
    "check_kda_inputs",
    "chunk_gated_delta_rule",
    "chunk_kda",
    "expand_values",
    "fused_kda_gate",
    "fused_moe",
    "fused_recurrent_kda",
    "gated_rms_norm",
    "l2norm",
    "logits_and_greedy",
    "naive_recurrent_kda",
    "paged_decode_rows",
    "paged_mla_decode",
    "project_add_rms_norm",
    "rms_norm_write",
    "router_logits",
    "short_conv",
    "sigmoid_topk",
]
