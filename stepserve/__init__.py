"""stepserve: an LLM serving engine with per-step scheduling policies."""

__all__ = ["LLM", "SamplingParams", "Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "AsyncEngine"]
__version__ = "0.1.0"

# where each public name lives: imported when first asked for, so that a command that runs no engine (the
# replay client, --help) does not pay for torch's import (~1.3 s) on every start
_HOMES = {
    "LLM": "stepserve.engine.llm",
    "SamplingParams": "stepserve.engine.sampling_params",
    "Engine": "stepserve.engine.engine",
    "EngineConfig": "stepserve.engine.engine",
    "RequestOutput": "stepserve.engine.request",
    "CompletionOutput": "stepserve.engine.request",
    "AsyncEngine": "stepserve.engine.async_engine",
}


def __getattr__(name):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'stepserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_HOMES))
