"""`Limits`: the one place a request's size is checked, by the server (as the
request enters, before anything is sent to the engine), the engine (for its
Python API callers) and the simulator (through `EngineCore`), with the same
rules and the same messages. A refusal is a `RequestError` naming the
parameter in the engine's terms (`prompt`, `max_tokens`); a front end renames
it to its API's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from stepserve.scheduler.errors import RequestError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


@dataclass(frozen=True)
class Limits:
    max_context: int  # tokens a sequence may reach, prompt and output together
    kv_capacity: int  # KV slots in the pool: a request that needs more can never run
    vocab_size: int | None = None  # prompt ids must lie in [0, vocab_size), when known
    # sequences one request may hold at once (its n branches decode side by side, each in a row of the
    # req->token pool): a request that wants more can never be admitted, and would block the queue behind it
    max_sequences: int | None = None

    def check_prompt(self, ids: Sequence[int]) -> None:
        """Not empty, room left for one generated token, ids in the vocabulary."""
        if not ids:
            raise RequestError("The prompt is empty", "prompt")
        if len(ids) >= self.max_context:  # before the range scan: that one is linear in a huge list
            raise RequestError(
                f"This model's maximum context length is {self.max_context} tokens; the prompt has {len(ids)} "
                "tokens and must leave room for at least one generated token", "prompt", CONTEXT_LENGTH_EXCEEDED)
        vocab = self.vocab_size
        if vocab is not None:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"Token ids out of vocabulary (the range [0, {vocab})): {bad[:5]}", "prompt")

    def check_n(self, n: int) -> None:
        """`n` branches fit the sequences the engine holds at once."""
        if self.max_sequences is not None and n > self.max_sequences:
            raise RequestError(f"n ({n}) asks for more sequences at once than this engine holds "
                               f"({self.max_sequences}; raise max_running, --max-running)", "n")

    def max_tokens(self, prompt_len: int, requested: int | None, default: int | None = None) -> int:
        """The generation cap for a prompt of this length: `requested`, or else
        `default` clipped to the room left (or all of it); refused if it does
        not fit the context or the KV pool."""
        room = self.max_context - prompt_len
        if requested is None:
            cap = room if default is None else min(default, room)
        elif requested < 1:
            raise RequestError(f"max_tokens must be at least 1, got {requested}", "max_tokens")
        elif requested > room:
            raise RequestError(
                f"max_tokens ({requested}) plus the prompt ({prompt_len} tokens) exceeds the model's maximum "
                f"context length of {self.max_context} tokens", "max_tokens", CONTEXT_LENGTH_EXCEEDED)
        else:
            cap = requested
        if prompt_len + cap > self.kv_capacity:
            raise RequestError(f"The request needs {prompt_len + cap} KV slots; the pool holds {self.kv_capacity}",
                               "max_tokens")
        return cap
