"""k3: Kimi K3 in pure PyTorch. Public API: K3Config, K3ForCausalLM, PRESETS (and the ``k3`` CLI)."""

from .config import PRESETS, K3Config
from .model.transformer import K3ForCausalLM, K3Model

__version__ = "0.1.0"
__all__ = ["K3Config", "K3ForCausalLM", "K3Model", "PRESETS"]
