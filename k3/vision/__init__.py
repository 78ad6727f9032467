"""Vision (SPEC §10): MoonViT-V2 (and Kimi K2.5's MoonViT), the projector into the language model, native-resolution
preprocessing, and K3ForConditionalGeneration, which splices image features into the text at placeholder tokens."""

from .config import VISION_PRESETS, VisionConfig
from .model import K3ForConditionalGeneration, Projector, tokens_per_image
from .tower import MoonViT

__all__ = ["VisionConfig", "VISION_PRESETS", "MoonViT", "Projector", "K3ForConditionalGeneration",
           "tokens_per_image"]
