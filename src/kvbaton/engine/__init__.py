"""The built-in PyTorch engine: scheduler, block manager, Llama-family model runner, sampler."""

from kvbaton.engine.async_engine import AsyncEngine
from kvbaton.engine.config import EngineConfig
from kvbaton.engine.engine import EngineStats, LLMEngine
from kvbaton.engine.llm import LLM, RequestOutput
from kvbaton.protocols.llm import EngineOutput, SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "EngineConfig",
    "EngineOutput",
    "EngineStats",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]
