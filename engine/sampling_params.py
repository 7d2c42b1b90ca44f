"""Per-request sampling parameters (vLLM/OpenAI-compatible names and defaults).

``SamplingParams`` is a plain dataclass.  Construction normalises a few
convenience forms (``stop="x"`` -> ``["x"]``, ``stop_token_ids=None`` -> ``[]``,
JSON-style string keys in ``logit_bias`` -> ``int``) and then validates
everything that can be checked without knowing the model;
``check_token_ids(vocab_size)`` adds the token-id checks where a request
enters (the server, or ``Engine.add_request``; once per vocabulary, so a
request the server checked is not checked again), and ``validate(vocab_size)``
checks everything again (after mutating a field).  Every violation raises a
``RequestError`` (a ``ValueError``) naming the parameter (``.param``), its
message starting with that name.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from stepserve.scheduler.errors import RequestError

__all__ = ["SamplingParams", "MAX_LOGPROBS", "GREEDY_TEMPERATURE_EPS"]

# Most alternatives a request may ask for (OpenAI's limit for ``top_logprobs``).
MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy (as vLLM does): dividing logits
# by a denormal-ish temperature would overflow to inf and give NaNs.
GREEDY_TEMPERATURE_EPS = 1e-5
# Bounds of OpenAI's logit_bias / presence / frequency parameters.
MAX_LOGIT_BIAS = 100.0
MAX_ABS_PRESENCE_FREQUENCY = 2.0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _err(name: str, msg: str, value) -> RequestError:
    return RequestError(f"{name} {msg}, got {value!r}", name)


def _check_int(name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> None:
    if not _is_int(value):
        raise _err(name, "must be an int", value)
    if lo is not None and value < lo:
        raise _err(name, f"must be >= {lo}", value)
    if hi is not None and value > hi:
        raise _err(name, f"must be <= {hi}", value)


def _check_real(name: str, value) -> None:
    if not _is_real(value):
        raise _err(name, "must be a number", value)
    if not math.isfinite(value):
        raise _err(name, "must be finite", value)


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise _err(name, "must be a bool", value)


@dataclass
class SamplingParams:
    """Sampling parameters of one request (defaults follow vLLM).

    * ``max_tokens=None`` means "until the context is full".
    * ``top_k`` of ``-1`` or ``0`` disables top-k; values above the vocabulary
      size are allowed (the sampler clamps them).
    * ``logprobs``: ``None`` = no logprobs; ``0`` = only the chosen token's
      logprob; ``k >= 1`` = the chosen token's plus the ``k`` most likely
      alternatives.  Logprobs come from the raw model distribution.
    * ``prompt_logprobs``: the same for every prompt token after the first (the
      logprob the model gives it after the tokens before it). The prompt is
      then computed in full, without the prefix cache.
    * ``seed``: ``None`` means the engine picks one per request.
    """

    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding (e.g. a JSON-schema grammar): called once per branch,
    # it returns that branch's processor ``proc(output_ids, logits_row)``, which
    # the model runner calls before sampling each of the branch's tokens; it
    # masks/edits the float row in place (``output_ids``: the branch's tokens so
    # far, so a stateful matcher can advance itself). Logprobs then describe the
    # constrained distribution. ``None``: unconstrained (no per-step cost).
    logits_processor_factory: Optional[Callable[[], Callable[[list, Any], None]]] = None
    # Speculative decoding (when the engine runs it): False opts this request out.
    # Output is exact either way; a constrained request (a logits processor) never speculates.
    speculative: bool = True

    # ------------------------------------------------------------------ setup
    def __post_init__(self) -> None:
        self._normalise()
        self.validate()

    def _normalise(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (tuple, list)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (tuple, list)):
            self.stop_token_ids = [int(t) if _is_int(t) else t for t in self.stop_token_ids]
        if isinstance(self.logit_bias, dict):
            # JSON objects (the OpenAI API) carry token ids as strings.
            fixed = {}
            for key, value in self.logit_bias.items():
                if isinstance(key, str):
                    try:
                        key = int(key.strip())
                    except ValueError:
                        raise _err("logit_bias", "keys must be token ids", key) from None
                elif _is_int(key):  # numpy integers -> int
                    key = int(key)
                fixed[key] = value
            self.logit_bias = fixed

    # ------------------------------------------------------------- validation
    def check_token_ids(self, vocab_size: int) -> "SamplingParams":
        """The checks that need the vocabulary (``stop_token_ids`` and
        ``logit_bias`` keys in ``[0, vocab_size)``), once per vocabulary: the
        other fields were checked at construction. Returns ``self``."""
        if self._checked_vocab == vocab_size:
            return self
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise _err("stop_token_ids", f"entries must be token ids in [0, {vocab_size})", t)
        for tok in self.logit_bias or ():
            if not 0 <= tok < vocab_size:
                raise _err("logit_bias", f"keys must be token ids in [0, {vocab_size})", tok)
        self._checked_vocab = vocab_size
        return self

    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Raise ``RequestError`` naming the first out-of-range parameter.

        With ``vocab_size`` given, token ids in ``stop_token_ids`` and
        ``logit_bias`` must also lie in ``[0, vocab_size)`` (``check_token_ids``).
        Returns ``self``.
        """
        self._normalise()
        _check_int("n", self.n, lo=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)  # as vLLM: a request generates at least one token
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens!r}", "min_tokens"
            )

        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise _err("temperature", "must be >= 0", self.temperature)
        _check_real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise _err("top_p", "must be in (0, 1]", self.top_p)
        _check_int("top_k", self.top_k, lo=-1)
        _check_real("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise _err("min_p", "must be in [0, 1]", self.min_p)

        _check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise _err("repetition_penalty", "must be > 0", self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value)
            if abs(value) > MAX_ABS_PRESENCE_FREQUENCY:
                raise _err(name, "must be in [-2, 2]", value)

        if self.seed is not None:
            _check_int("seed", self.seed)
            if not -(1 << 63) <= self.seed < (1 << 63):  # (a seed is an int64, as on the HTTP routes: beyond,
                raise RequestError(f"seed must be a 64-bit signed integer, got {self.seed}", "seed")  # two met)

        if not isinstance(self.stop, list):
            raise _err("stop", "must be a string, a list of strings or None", self.stop)
        for s in self.stop:
            if not isinstance(s, str):
                raise _err("stop", "entries must be strings", s)
            if s == "":
                raise RequestError("stop must not contain empty strings", "stop")

        if not isinstance(self.stop_token_ids, list):
            raise _err("stop_token_ids", "must be a list of ints or None", self.stop_token_ids)
        for t in self.stop_token_ids:
            if not _is_int(t):
                raise _err("stop_token_ids", "entries must be ints", t)
            if t < 0:
                raise _err("stop_token_ids", "entries must be token ids (>= 0)", t)

        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)

        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _err("logit_bias", "must be a dict {token_id: bias} or None", self.logit_bias)
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise _err("logit_bias", "keys must be token ids (ints >= 0)", tok)
                if not _is_real(bias) or not math.isfinite(bias) or abs(bias) > MAX_LOGIT_BIAS:
                    raise _err("logit_bias", f"values must be in [-100, 100] (token {tok})", bias)

        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _check_bool("speculative", self.speculative)
        if self.logits_processor_factory is not None and not callable(self.logits_processor_factory):
            raise _err("logits_processor_factory", "must be callable or None", self.logits_processor_factory)
        self._checked_vocab = None
        if vocab_size is not None:
            _check_int("vocab_size", vocab_size, lo=1)
            self.check_token_ids(vocab_size)
        return self

    # ------------------------------------------------------------- properties
    @property
    def greedy(self) -> bool:
        """Deterministic argmax decoding: temperature ~ 0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """Whether repetition/presence/frequency penalties change anything."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> "SamplingParams":
        """A deep copy (lists and dicts are not shared)."""
        return copy.deepcopy(self)
