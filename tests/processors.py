"""Logits processors for tests."""

from __future__ import annotations


class NoRepeat:
    """A logits processor factory whose processor reads its sequence's
    output, as a grammar does: it forbids the last output token. It must
    never be shown a placeholder (the overlap schedule samples such rows
    only once the tokens of the step before are on the host)."""

    def __call__(self):
        def process(output_ids, logits):
            assert all(t >= 0 for t in output_ids), output_ids
            if output_ids:
                logits[output_ids[-1]] = float("-inf")
        return process
