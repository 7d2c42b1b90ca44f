"""stepserve: an LLM serving engine with per-step scheduling policies."""

from stepserve.engine.engine import Engine, EngineConfig
from stepserve.engine.llm import LLM
from stepserve.engine.request import CompletionOutput, RequestOutput
from stepserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "AsyncEngine"]
__version__ = "0.1.0"


def __getattr__(name):
    # AsyncEngine pulls in asyncio machinery only when asked for
    if name == "AsyncEngine":
        from stepserve.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(name)
