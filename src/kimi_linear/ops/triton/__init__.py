"""Triton kernels for KDA on CUDA (issue 4). :mod:`kimi_linear.ops.backend` dispatches CUDA tensors here.

Imports cleanly without a GPU (the tests run the kernels under ``TRITON_INTERPRET=1`` on CPU tensors).
"""

from .chunk import chunk_kda
from .mla_decode import paged_mla_decode
from .recurrent import fused_recurrent_kda

# The short-conv and gated-norm kernels (conv.py, norm.py) are tested under the interpreter but have not yet run on
# a GPU: the public ops dispatch to them once bench/kda_layer.py's full-size check passes there (add them here).
# paged_mla_decode (issue 18) is exported before its GPU run: only the paged MLA step (layers.mla.PagedLatentView)
# calls it; if bench/mla_decode_gpu.py fails on the GPU, dropping it here sends that step to the PyTorch path.
__all__ = ["chunk_kda", "fused_recurrent_kda", "paged_mla_decode"]
