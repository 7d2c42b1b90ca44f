"""Offline Python API: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from stepserve.engine.engine import Engine, EngineConfig
from stepserve.engine.request import RequestOutput
from stepserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None, **engine_kwargs):
        """`LLM(model_dir, max_running=..., ...)`, or `LLM(config=EngineConfig(...))`."""
        if config is None:
            config = EngineConfig(model=model, **engine_kwargs)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, not {type(config).__name__}")
        elif model is not None or engine_kwargs:
            raise ValueError("pass either config or model/engine options, not both")
        if config.step_log is not None:  # written by the serving loop only: it would stay empty here
            raise ValueError("step_log is written by the serving loop (AsyncEngine, `stepserve serve --step-log`), "
                             "not by LLM")
        self.engine = Engine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stages: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order.
        `stages` makes every prompt a fork/join request with these later
        stages (`Engine.add_request`); its outputs are every branch of every
        stage, `index` in order and `stage` saying which."""
        if isinstance(prompts, (torch.Tensor, np.ndarray)):  # one prompt of ids (1-D), or one per row (2-D)
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        elif isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # validate everything before queueing anything, so a bad prompt in the
        # list leaves no half-submitted batch behind
        reqs = []
        try:
            for p, sp in zip(prompts, params):
                reqs.append(self.engine.add_request(p, sp, stages=stages))
        except Exception:
            for r in reqs:
                self.engine.abort_request(r.request_id)
            raise
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:  # (a KeyboardInterrupt, a logits processor that raised) none of them runs on later
            for r in reqs:
                self.engine.abort_request(r.request_id)
            raise
        return [r.output(delta=False) for r in reqs]

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's `LLM.reset_prefix_cache`); between
        `generate` calls no request holds a prefix, so all of it goes."""
        self.engine.flush_cache()
        return True

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        for conv in convs:
            for i, m in enumerate(conv):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or (
                        "content" not in m and "tool_calls" not in m):
                    raise ValueError(f"messages[{i}]: a message is a dict with a role and its content, got {m!r}")
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
