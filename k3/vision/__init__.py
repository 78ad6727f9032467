"""Vision (SPEC §10): MoonViT-V2 (and Kimi K2.5's MoonViT), the projector into the language model, native-resolution
preprocessing, K3ForConditionalGeneration, which splices image features into the text at placeholder tokens, and
encode_chat, which turns chat messages with image parts into token ids and images (chat, serve, SFT data)."""

from .chat import ChatImages, encode_chat
from .config import VISION_PRESETS, VisionConfig
from .model import K3ForConditionalGeneration, Projector, count_vision_parameters, tokens_per_image
from .preprocess import ImageError, load_image
from .tower import MoonViT

__all__ = ["VisionConfig", "VISION_PRESETS", "MoonViT", "Projector", "K3ForConditionalGeneration",
           "tokens_per_image", "count_vision_parameters", "encode_chat", "ChatImages", "load_image", "ImageError"]
