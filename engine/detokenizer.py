"""Incremental detokenization and stop-string matching.

Text is produced token by token without re-decoding the whole output: the
`tokenizers` library's `DecodeStream` buffers tokens until they form complete
UTF-8, so a multi-byte character split across tokens is never emitted half-way
(no U+FFFD in the stream). Slow tokenizers fall back to decoding the output
with a lookbehind window.
"""

from __future__ import annotations

from typing import Sequence

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - depends on the installed version
    DecodeStream = None

# prompt tokens fed to the decoder first, so the first output token decodes
# with the right context (e.g. a leading space marker)
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend
        self._stream = None
        if DecodeStream is not None and backend is not None:
            ctx = list(prompt_ids[-_PROMPT_CONTEXT:])
            try:
                self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
            except TypeError:  # older DecodeStream without `ids`
                self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted = ""

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the newly completed text ('' if none yet)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self._ids.append(token_id)
        text = self.tokenizer.decode(self._ids, skip_special_tokens=self.skip_special_tokens)
        if text.endswith("\ufffd"):
            return ""
        new = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._emitted = text
        return new


    def decode_all(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def find_stop(text: str, stops: Sequence[str], new_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last `new_len` characters of text.

    Returns (index where it starts, the stop string) or None. Only the tail that
    could contain a new match is searched, so this is O(new text + longest stop).
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        i = text.find(stop, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop
    string: streaming holds that much back, since it may become a stop."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
