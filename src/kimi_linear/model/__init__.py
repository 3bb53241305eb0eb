"""The Kimi Linear model: config handling, the decoder, the hybrid cache, checkpoints and generation."""

from .cache import HybridCache
from .config import PRESETS, config_from_dict, config_to_dict, load_config, preset_config, validate_config
from .generation import generate, sample_next
from .modeling import CausalLMOutput, KimiLinearDecoderLayer, KimiLinearForCausalLM, KimiLinearModel

__all__ = [
    "PRESETS",
    "CausalLMOutput",
    "HybridCache",
    "KimiLinearDecoderLayer",
    "KimiLinearForCausalLM",
    "KimiLinearModel",
    "config_from_dict",
    "config_to_dict",
    "generate",
    "load_config",
    "preset_config",
    "sample_next",
    "validate_config",
]
