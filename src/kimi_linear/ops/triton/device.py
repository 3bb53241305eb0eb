"""Facts about the device a launch runs on, for grids sized to the card (persistent launches, split counts)."""

from __future__ import annotations

import torch


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); 4 elsewhere (the interpreter runs programs one
    by one, so few splits keep CPU runs short)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
