"""Tool calling on `/v1/chat/completions`: what the model is asked for, and
how its text becomes OpenAI `tool_calls`.

- `tool_choice` "none" (or no tools): plain chat; the tools are not rendered.
- "auto": the tools go to the chat template (`tools=`), and the output is
  parsed for the Hermes / Qwen form `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the blocks stays content.
- "required": the output is constrained (llguidance) to a JSON array of one
  or more calls, each `{"name": one of the tools, "arguments": valid for that
  tool's parameters}`.
- a named function: the output is constrained to JSON valid for that
  function's parameters: the call's arguments. The call is returned even
  when max_tokens cuts its arguments short (`finish_reason: "length"` says
  so), streamed or not, as OpenAI and vLLM answer.
A response with calls that ended by itself has `finish_reason: "tool_calls"`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        return {"index": index, **self.message()}


def call_from_json(obj) -> ToolCall | None:
    """{"name": str, "arguments": object or JSON text} -> a ToolCall (None if not one)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that could begin OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Incremental parser of the `<tool_call>...</tool_call>` form ("auto").
    `feed(text)` returns (content to emit now, calls completed now); text that
    might start a block is held back until it is known not to. A block whose
    JSON is not a call is passed through as content."""

    def __init__(self):
        self.buf = ""
        self.inside = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        content, done = [], []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_open(self.buf)
                    content.append(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content.append(self.buf[:i])
                self.buf = self.buf[i:]
                self.inside = True
            j = self.buf.find(CLOSE)
            if j < 0:
                break
            block = self.buf[len(OPEN):j]
            self.buf = self.buf[j + len(CLOSE):]
            self.inside = False
            try:
                call = call_from_json(json.loads(block))
            except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
                call = None
            if call is None:
                content.append(OPEN + block + CLOSE)
            else:
                done.append(call)
        self.calls.extend(done)
        return "".join(content), done

    def finish(self) -> str:
        """What is still held back, as content (an unclosed block included)."""
        rest, self.buf, self.inside = self.buf, "", False
        return rest


def parse_constrained(text: str) -> list[ToolCall]:
    """The calls in the output of a "required" request (a JSON array of
    calls); [] if it is not complete JSON (the output was cut by max_tokens)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return []
    calls = [call_from_json(o) for o in obj] if isinstance(obj, list) else []
    return [c for c in calls if c is not None]


def constrained_schema(tools: list[dict], tool_choice) -> dict | None:
    """The JSON schema a "required" or named `tool_choice` constrains the
    output to (None for "none" and "auto")."""
    def params(t):
        return t["function"].get("parameters") or {"type": "object"}

    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return params(next(t for t in tools if t["function"]["name"] == name))
    if tool_choice == "required":
        one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": params(t)},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        return {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    return None


class ChoiceTools:
    """One choice's text seen through its request's tool mode: the deltas to
    stream (`feed`, then `finish`) and the whole message (`message`).
    `mode`: "auto", "required" or "named" (never built for "none")."""

    def __init__(self, mode: str, tool_choice, parallel: bool):
        self.mode, self.tool_choice, self.parallel = mode, tool_choice, parallel
        self.parser = ToolCallParser() if mode == "auto" else None
        self.text: list[str] = []
        self.calls: list[ToolCall] = []
        self.named: ToolCall | None = None  # the named call, streamed as its arguments arrive

    def _keep(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.parallel:  # parallel_tool_calls=false: one call at most
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls

    def feed(self, text: str) -> list[dict]:
        """Deltas for `text`, the choice's next output."""
        if self.mode == "auto":
            content, calls = self.parser.feed(text)
            out = [{"content": content}] if content else []
            start = len(self.calls)
            return out + [{"tool_calls": [c.delta(start + i)]} for i, c in enumerate(self._keep(calls))]
        self.text.append(text)
        if self.mode == "named" and text:
            if self.named is None:
                self.named = ToolCall(self.tool_choice["function"]["name"], "")
                head = self.named.delta(0)
                head["function"] = {"name": self.named.name, "arguments": text}
                return [{"tool_calls": [head]}]
            return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        return []  # "required": a JSON array, parsed whole at the end

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """The last deltas and the finish reason, once the output ended."""
        out: list[dict] = []
        if self.mode == "auto":
            rest = self.parser.finish()
            if rest:
                out.append({"content": rest})
        elif self.mode == "required":
            text = "".join(self.text)
            calls = self._keep(parse_constrained(text))
            out = [{"tool_calls": [c.delta(i)]} for i, c in enumerate(calls)] or (
                [{"content": text}] if text else [])
        elif self.named is not None:  # the call whose id and arguments were streamed (cut short by
            self.named.arguments = "".join(self.text).strip()  # max_tokens too: finish_reason "length")
            self.calls = [self.named]
        elif self.mode == "named":  # no text at all (a stop string or max_tokens before any): the call with
            # empty arguments, as the whole message has it
            self.named = ToolCall(self.tool_choice["function"]["name"], "")
            self.calls = [self.named]
            out = [{"tool_calls": [self.named.delta(0)]}]
        return out, ("tool_calls" if self.calls and reason == "stop" else reason)

    def message(self, text: str, reason: str) -> tuple[dict, str]:
        """The whole message (content, tool_calls) and the finish reason."""
        if self.mode == "auto":
            content, calls = self.parser.feed(text)
            content += self.parser.finish()
            self._keep(calls)
        elif self.mode == "named":  # the call, its arguments as generated: valid JSON for the schema unless
            # max_tokens cut them short, which finish_reason "length" says (as OpenAI and vLLM answer)
            self._keep([ToolCall(self.tool_choice["function"]["name"], text.strip())])
            content = ""
        else:
            self._keep(parse_constrained(text))
            content = "" if self.calls else text
        msg = {"content": content.strip() if self.calls else content}
        if self.calls:
            msg = {"content": msg["content"] or None, "tool_calls": [c.message() for c in self.calls]}
        return msg, ("tool_calls" if self.calls and reason == "stop" else reason)
