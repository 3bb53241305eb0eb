"""kimi-linear: Kimi Delta Attention and the Kimi Linear / Kimi K3 model family."""

__version__ = "0.1.0"

__all__ = ["HybridCache", "KimiLinearConfig", "KimiLinearForCausalLM", "__version__"]


def __getattr__(name: str):
    # Lazy: `import kimi_linear.ops` must not pull in transformers (an optional dependency).
    if name in ("KimiLinearForCausalLM", "HybridCache"):
        from . import model

        return getattr(model, name)
    if name == "KimiLinearConfig":
        from transformers import KimiLinearConfig

        return KimiLinearConfig
    raise AttributeError(f"module 'kimi_linear' has no attribute {name!r}")
