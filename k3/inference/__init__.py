"""Inference (SPEC §7): the engine, its requests and events, the hybrid paged cache."""

from .api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from .engine import Engine, EngineConfig, RequestHandle

__all__ = ["Engine", "EngineConfig", "RequestHandle", "GenerationRequest", "SamplingParams", "TokenEvent",
           "FinishEvent"]
