"""`response_format` (JSON object / JSON schema) to an engine grammar
(`stepserve.engine.grammar`, llguidance), with a 400 for an invalid schema."""

from __future__ import annotations

from stepserve.engine.grammar import GrammarFactory, json_schema_grammar
from stepserve.server.errors import bad_request


class GrammarCompiler:
    """Per app: compiles response formats against the served tokenizer."""

    def __init__(self, tokenizer, tokenizer_dir: str, vocab_size: int, eos_ids):
        self.tokenizer = tokenizer
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def compile(self, response_format) -> GrammarFactory | None:
        """A factory for `response_format` (None for plain text). Blocking:
        call it in a worker thread. Invalid schemas raise a 400 APIError."""
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            schema = {"type": "object"}
        else:
            schema = response_format.json_schema.schema_
        try:
            return json_schema_grammar(schema, self.tokenizer_dir, self.vocab_size, self.eos_ids, self.tokenizer)
        except ValueError as e:
            raise bad_request(f"Invalid JSON schema in response_format: {e}", "response_format") from None
