"""k3: Kimi K3 in pure PyTorch. Public API: K3Config, K3ForCausalLM, PRESETS (and the ``k3`` CLI).

The names are imported on first use (PEP 562), so ``python -m k3`` runs ``k3.__main__`` before torch is imported:
a Ctrl-C during that import is then k3's to report (one line, status 130), not a traceback."""

__version__ = "0.1.0"
__all__ = ["K3Config", "K3ForCausalLM", "K3Model", "PRESETS"]


def __getattr__(name: str):
    if name in ("K3Config", "PRESETS"):
        from . import config

        return getattr(config, name)
    if name in ("K3ForCausalLM", "K3Model"):
        from .model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module 'k3' has no attribute {name!r}")
