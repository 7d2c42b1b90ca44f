"""`response_format` (JSON object / JSON schema), vLLM's `structured_outputs`
(json, regex, choice, grammar) and tool schemas to an engine grammar
(`stepserve.engine.grammar`, llguidance), with a 400 for an invalid one."""

from __future__ import annotations

from stepserve.engine.grammar import GrammarFactory, compile_grammar
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
        return self.compile_schema(schema, "response_format")

    def compile_schema(self, schema: dict, param: str) -> GrammarFactory:
        """A factory for JSON valid under `schema`; a 400 naming `param` if it does not compile."""
        return self.compile_kind("json", schema, param)

    def compile_kind(self, kind: str, spec, param: str) -> GrammarFactory:
        """A factory for a constraint of `kind` (`engine.grammar.grammar_text`);
        a 400 naming `param` if it does not compile."""
        try:
            return compile_grammar(kind, spec, self.tokenizer_dir, self.vocab_size, self.eos_ids, self.tokenizer)
        except ValueError as e:
            what = "JSON schema" if kind == "json" else kind
            raise bad_request(f"Invalid {what} in {param}: {e}", param) from None
