"""Serving engine for Kimi Linear: continuous batching, chunked prefill, KDA state slots + paged MLA latents,
prefix caching, per-request sampling (issue 6)."""

from .config import EngineConfig, parse_bytes
from .engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "parse_bytes"]
