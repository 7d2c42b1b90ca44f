"""The step-policy hook: each policy may reshape a plan before it runs and
observes what the step cost. Policies run in a fixed order (layout -> branch
admission -> speculation length); the default does nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from stepserve.scheduler.plan import StepPlan, StepRecord


@dataclass
class EngineView:
    """Read-only facts about the engine a policy may consult."""

    now: float
    num_running: int
    num_waiting: int
    kv_available: int
    kv_capacity: int
    max_batched_tokens: int = 0  # the step's token budget (0: unknown)
    max_context: int = 0  # the model's context (0: unknown)
    # (decode steps committed since the last step that ran prompt tokens, that step's prompt tokens):
    # the `latency_model.SincePrompt` of the steps before the one being planned (`ServingCosts.cold`)
    since_prompt: tuple[int, int] = (0, 0)


class StepPolicy(Protocol):
    name: str

    def plan(self, plan: StepPlan, view: EngineView) -> StepPlan: ...

    def observe(self, plan: StepPlan, record: StepRecord) -> None: ...


class NoopPolicy:
    name = "noop"

    def plan(self, plan: StepPlan, view: EngineView) -> StepPlan:
        return plan

    def observe(self, plan: StepPlan, record: StepRecord) -> None:
        return None
