"""Whether a kernel may take TMA tensor descriptors (Triton's host-side ``TensorDescriptor``) on a device.

Hopper and later copy a descriptor's tiles into shared memory with the tensor memory accelerator, which Triton's
software pipeliner issues ``num_stages - 1`` loop steps ahead; pointer loads whose tiles feed a product are often
left to wait in registers instead (see chunk_wy.chunk_tile and moe.py). The interpreter implements descriptors too,
so the CPU tests run the same path.
"""

from __future__ import annotations

import os

import torch


def tensor_descriptor_class():
    """Triton's ``TensorDescriptor`` (Triton 3.3 and later; torch 2.5 brings 3.1), or None."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def tma_supported(device: torch.device) -> bool:
    """Descriptors can be used for tensors on ``device``: a CUDA device of compute capability 9 or later, or the
    CPU under Triton's interpreter; and a Triton that has them."""
    if tensor_descriptor_class() is None:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
