"""Kimi Linear layers: the KDA block, NoPE MLA with a latent cache, the sigmoid-routed MoE, SwiGLU MLP, RMSNorm.

Each is a small ``nn.Module`` whose parameter names are the checkpoint's; the KDA block calls
:mod:`kimi_linear.ops`, so it runs the GPU kernels when they are available.
"""

from .activation import SiTUGLU, make_glu, silu_glu
from .attn_res import AttnResState, depth_mix
from .kda import KDAState, KimiDeltaAttention, PooledKDAState, VarlenKDAState
from .linear import Linear
from .mla import LatentCache, NoPEMLA, PagedLatentView, PagedPrefillView, VarlenLatents, pool_rows
from .mlp import SwiGLUMLP
from .moe import Expert, SigmoidTopKRouter, SparseMoE
from .norm import GatedRMSNorm, RMSNorm

__all__ = [
    "AttnResState",
    "SiTUGLU",
    "depth_mix",
    "make_glu",
    "silu_glu",
    "Expert",
    "GatedRMSNorm",
    "KDAState",
    "KimiDeltaAttention",
    "LatentCache",
    "Linear",
    "NoPEMLA",
    "PagedLatentView",
    "PagedPrefillView",
    "PooledKDAState",
    "RMSNorm",
    "SigmoidTopKRouter",
    "SparseMoE",
    "SwiGLUMLP",
    "VarlenKDAState",
    "VarlenLatents",
    "pool_rows",
]
