"""Constrained decoding for `response_format` (JSON object / JSON schema) with
llguidance.

llguidance compiles a JSON schema to a grammar and, per branch, a matcher
computes the set of allowed next tokens as a bitmask (tens of microseconds per
token, in Rust). The engine's hook is `SamplingParams.logits_processor_factory`:
each branch gets a `GrammarProcessor`, which the model runner calls on that
branch's logits row before sampling; it advances the matcher over the tokens
sampled since its last call and sets every forbidden logit to -inf. Rows without
a grammar cost nothing.

Once the grammar is complete only EOS is allowed, so a constrained output ends
with finish_reason "stop" exactly when the JSON is complete.
"""

from __future__ import annotations

import json
import threading

import torch

from stepserve.server.errors import bad_request

# compact JSON: no free whitespace between tokens, which a weak model could
# otherwise emit forever; the output is still ordinary JSON
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarProcessor:
    """One branch's matcher state; called as proc(output_ids, logits_row)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.consumed = 0
        self.words = (vocab_size + 31) // 32
        self.bitmask = torch.empty(self.words, dtype=torch.int32)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> None:
        m = self.matcher
        for tok in output_ids[self.consumed:]:
            if not m.is_stopped():
                m.consume_token(tok)
        self.consumed = len(output_ids)
        if m.is_error() or m.is_stopped():
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[self.eos_ids] = True
        else:
            m.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.words * 4)
            bits = (self.bitmask[:, None] >> _SHIFTS) & 1
            allowed = bits.reshape(-1)[: self.vocab_size].bool()
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarFactory:
    """`logits_processor_factory` for one request: a compiled prototype matcher,
    copied per branch (copying is cheap; compiling may not be)."""

    def __init__(self, prototype, vocab_size: int, eos_ids: list[int]):
        self.prototype = prototype
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def __call__(self) -> GrammarProcessor:
        return GrammarProcessor(self.prototype.deep_copy(), self.vocab_size, self.eos_ids)

    def __deepcopy__(self, memo):  # SamplingParams.clone() shares it; branches copy on call
        return self


class GrammarCompiler:
    """Per app: the llguidance view of the tokenizer, built on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self._lltok = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance.hf

                self._lltok = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._lltok

    def compile(self, response_format) -> GrammarFactory | None:
        """A factory for `response_format` (None for plain text). Blocking:
        call it in a worker thread. Invalid schemas raise a 400 APIError."""
        if response_format is None or response_format.type == "text":
            return None
        import llguidance

        if response_format.type == "json_object":
            schema = {"type": "object"}
        else:
            schema = response_format.json_schema.schema_
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise bad_request(f"Invalid JSON schema in response_format: {e}", "response_format") from None
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise bad_request(f"Invalid JSON schema in response_format: {matcher.get_error()}", "response_format")
        return GrammarFactory(matcher, self.vocab_size, self.eos_ids)
