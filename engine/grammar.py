"""Constrained decoding (JSON schema, regex, choice, Lark grammar) with llguidance.

llguidance compiles a JSON schema to a grammar and, per branch, a matcher
computes the set of allowed next tokens as a bitmask (tens of microseconds per
token, in Rust). The engine's hook is `SamplingParams.logits_processor_factory`:
each branch gets a `GrammarProcessor`, which the model runner calls on that
branch's logits row before sampling; it advances the matcher over the tokens
sampled since its last call and sets every forbidden logit to -inf. Rows without
a grammar cost nothing.

The factory (`GrammarFactory`) is plain data (the grammar text and where the
tokenizer lives), so it pickles into an engine process; each process compiles
a grammar once and keeps the compiled matcher in a small cache, copying it per
branch.

Once the grammar is complete only EOS is allowed, so a constrained output ends
with finish_reason "stop" exactly when the JSON is complete. A matcher that
gives up on the way (llguidance's limits: a regex or grammar that grows too
complex as the output goes on) says why in `GrammarProcessor.error`; the
engine then ends the branch with finish_reason "abort" and that error, which
the server answers as a 400 (`Engine.updated`), never as a finished output.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

# compact JSON: no free whitespace between tokens, which a weak model could
# otherwise emit forever; the output is still ordinary JSON
_JSON_OPTIONS = {"whitespace_flexible": False}
_SHIFTS = torch.arange(32, dtype=torch.int32)
_MAX_CACHED = 64


class GrammarProcessor:
    """One branch's matcher state; called as proc(output_ids, logits_row)."""

    def __init__(self, matcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self.consumed = 0
        self.error: str | None = None  # why the matcher gave up before the output was complete (then only EOS)
        self.words = (vocab_size + 31) // 32
        self.bitmask = torch.empty(self.words, dtype=torch.int32)

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> None:
        m = self.matcher
        for tok in output_ids[self.consumed:]:
            if not m.is_stopped():
                m.consume_token(tok)
        self.consumed = len(output_ids)
        if m.is_error() and self.error is None:
            self.error = m.get_error()
        if m.is_error() or m.is_stopped():
            allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
            allowed[self.eos_ids] = True
        else:
            m.unsafe_compute_mask_ptr(self.bitmask.data_ptr(), self.words * 4)
            bits = (self.bitmask[:, None] >> _SHIFTS) & 1
            allowed = bits.reshape(-1)[: self.vocab_size].bool()
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


@dataclass(frozen=True)
class GrammarFactory:
    """`logits_processor_factory` for one request: an llguidance grammar and the
    tokenizer it constrains. Calling it gives a fresh branch processor."""

    grammar: str
    tokenizer_dir: str
    vocab_size: int
    eos_ids: tuple[int, ...]

    def __call__(self) -> GrammarProcessor:
        return GrammarProcessor(_prototype(self).deep_copy(), self.vocab_size, self.eos_ids)

    def __deepcopy__(self, memo):  # SamplingParams.clone() shares it; branches copy on call
        return self


_lock = threading.Lock()
_ll_tokenizers: dict[tuple, object] = {}
_matchers: OrderedDict[GrammarFactory, object] = OrderedDict()


def _ll_tokenizer(tokenizer_dir: str, vocab_size: int, eos_ids: tuple[int, ...], tokenizer=None):
    """llguidance's view of a tokenizer, built once per process (slow for big vocabularies)."""
    key = (tokenizer_dir, vocab_size, eos_ids)
    with _lock:
        if key not in _ll_tokenizers:
            import llguidance.hf

            if tokenizer is None:
                from stepserve.engine.engine import load_tokenizer

                tokenizer = load_tokenizer(tokenizer_dir)
            _ll_tokenizers[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                                eos_token=list(eos_ids) or None)
        return _ll_tokenizers[key]


def _prototype(f: GrammarFactory, tokenizer=None):
    """The compiled matcher for f, from the cache or compiled now; ValueError
    if the grammar does not compile."""
    with _lock:
        m = _matchers.get(f)
        if m is not None:
            _matchers.move_to_end(f)
            return m
    import llguidance

    m = llguidance.LLMatcher(_ll_tokenizer(f.tokenizer_dir, f.vocab_size, f.eos_ids, tokenizer), f.grammar,
                             log_level=0)
    if m.is_error():
        raise ValueError(f"invalid grammar: {m.get_error()}")
    if not m.is_accepting() and not _any_token_but(m, f.vocab_size, f.eos_ids):
        # nothing can start an output and the empty one does not match (a JSON schema that only refers to
        # itself, a regex no string matches): llguidance leaves only the end tokens, and the request would
        # end at once with an empty answer that breaks its own constraint
        raise ValueError("the constraint matches no output at all")
    with _lock:
        _matchers[f] = m
        while len(_matchers) > _MAX_CACHED:
            _matchers.popitem(last=False)
    return m


def _any_token_but(m, vocab_size: int, eos_ids: tuple[int, ...]) -> bool:
    """Whether the matcher's mask allows some token of the vocabulary other
    than the end tokens."""
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:vocab_size]
    bits[[e for e in eos_ids if e < vocab_size]] = 0
    return bool(bits.any())


def grammar_text(kind: str, spec) -> str:
    """llguidance's grammar for a constraint: kind "json" (a JSON schema,
    dict), "regex", "choice" (a list of strings: exactly one of them) or
    "lark" (a Lark grammar); ValueError if it does not parse."""
    import llguidance

    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec), defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            if not spec or not all(isinstance(c, str) and c for c in spec):
                raise ValueError("choice must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None
    raise ValueError(f"unknown constraint kind {kind!r}")


def compile_grammar(kind: str, spec, tokenizer_dir: str, vocab_size: int, eos_ids, tokenizer=None) -> GrammarFactory:
    """A factory constraining output by `grammar_text(kind, spec)`; compiles it
    here once (blocking: call it off the event loop), so an invalid one raises
    ValueError now rather than in the engine."""
    f = GrammarFactory(grammar_text(kind, spec), tokenizer_dir, vocab_size, tuple(sorted(int(e) for e in eos_ids)))
    _prototype(f, tokenizer)
    return f


def json_schema_grammar(schema: dict, tokenizer_dir: str, vocab_size: int, eos_ids, tokenizer=None) -> GrammarFactory:
    """A factory constraining output to JSON valid under `schema` (see `compile_grammar`)."""
    return compile_grammar("json", schema, tokenizer_dir, vocab_size, eos_ids, tokenizer)


@dataclass(frozen=True)
class AllowedTokens:
    """`logits_processor_factory` that keeps only `token_ids` (vLLM's
    allowed_token_ids); plain data, so it pickles into an engine process."""

    token_ids: tuple[int, ...]

    def __call__(self):
        ids = torch.tensor(self.token_ids, dtype=torch.long)
        masks: dict = {}

        def process(output_ids: list[int], logits: torch.Tensor) -> None:
            keep = masks.get(logits.device)
            if keep is None:
                keep = masks[logits.device] = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
                keep[ids.to(logits.device)] = True
            logits.masked_fill_(~keep, float("-inf"))

        process.reads_output = False  # (the overlap schedule need not wait for the token in flight)
        return process
