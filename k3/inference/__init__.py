"""Inference (SPEC §7): the engine (scheduler, model runner, output processor), the page pool and the prefix
cache. The server and the CLI speak the types of ``api``."""

from .api import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from .engine import Engine, EngineConfig, EngineFailed, RequestHandle

__all__ = ["Engine", "EngineConfig", "EngineFailed", "RequestHandle", "GenerationRequest", "SamplingParams",
           "TokenEvent", "FinishEvent"]
