"""kimi-linear: Kimi Delta Attention and the Kimi Linear / Kimi K3 model family."""

__version__ = "0.1.0"
