"""`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`: OpenAI's Responses API.

A Responses request becomes a chat request (`to_chat`: `instructions` as the
system message, `input` items as messages, function calls and their outputs
as assistant tool calls and `tool` messages, `text.format` as the response
format, flat function tools as chat tools) and runs through the chat route's
preparation (`prepare_chat`): the same template, tool modes and grammars. The
answer is rendered as Responses output items: a `message` with `output_text`,
and a `function_call` item per call. Streams carry OpenAI's typed events.

`store` (default true) keeps the response, and the conversation that led to
it, in a bounded in-memory store (`ResponseStore`): `previous_response_id`
continues from it, and `GET /v1/responses/{id}` returns it. `background`
answers at once with a "queued" response that a task finishes in the store;
`POST /v1/responses/{id}/cancel` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from typing import Annotated, Literal, Optional, Union

from pydantic import ConfigDict, Field, ValidationError
from starlette.requests import Request

from stepserve.server.errors import APIError, SafeJSONResponse, bad_request, describe_errors
from stepserve.server.openai_chat import ChoiceTools, prepare_chat
from stepserve.server.openai_common import refuse_fields
from stepserve.server.protocol import (INT64_MAX, INT64_MIN, MAX_INT, UNSUPPORTED_FIELDS, ChatCompletionRequest,
                                       JsonObject, Seconds, Text, _Model, _SamplingFields)
from stepserve.server.serving import EngineClient

log = logging.getLogger("stepserve.server")

# fields of OpenAI's Responses API that would change the answer and are not implemented
UNSUPPORTED = {
    "conversation": "conversations", "prompt": "reusable prompts",
    "max_tool_calls": "max_tool_calls", "top_logprobs": "logprobs", "include": "include",
    # the chat and completions routes' names for what a response names otherwise, or has not
    "max_tokens": "max_tokens here (use max_output_tokens)",
    "max_completion_tokens": "max_completion_tokens here (use max_output_tokens)",
    "response_format": "response_format here (use text.format)",
    "n": "several outputs in one response", "best_of": "best_of", "use_beam_search": "beam search",
    "logprobs": "logprobs", "prompt_logprobs": "prompt logprobs", "echo": "echo", "suffix": "suffix",
    "stream_options": "stream_options here",
}
HARMLESS = {"include": ([],), "n": (1,), "best_of": (1,), "use_beam_search": (False,), "logprobs": (False,),
            "echo": (False,)}
# The chat route's sampling extensions (vLLM's, SGLang's: top_k, stop, penalties, constraints, ...): a
# response takes them too, passed on to the chat request it is (`to_chat`), whose checks and refusals apply
PASSED_ON = frozenset(_SamplingFields.model_fields) - {
    "model", "n", "temperature", "top_p", "seed", "user", "stream", "stream_options", "response_format",
    "slo_ttft", "slo_tpot"} | frozenset(UNSUPPORTED_FIELDS["chat"])


class ResponsesRequest(_Model):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True, allow_inf_nan=False)

    model: Optional[Text] = None
    input: Union[Text, Annotated[list[JsonObject], Field(min_length=1, max_length=4096)]]
    instructions: Optional[Text] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=MAX_INT)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False  # answer at once ("queued"); GET polls, POST .../cancel stops it
    previous_response_id: Optional[Text] = None
    text: Optional[JsonObject] = None
    tools: Optional[Annotated[list[JsonObject], Field(max_length=128)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], JsonObject]] = None
    parallel_tool_calls: bool = True
    metadata: Optional[JsonObject] = None
    user: Optional[Text] = None
    truncation: Literal["disabled", "auto"] = "disabled"
    reasoning: Optional[JsonObject] = None
    # the chat route's extensions, accepted here too
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    slo_ttft: Optional[Seconds] = None
    slo_tpot: Optional[Seconds] = None


class ResponseStore:
    """The last `capacity` stored responses, with the conversation of each
    (chat messages, its own output included) for `previous_response_id`."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()
        self.running: dict[str, asyncio.Task] = {}  # background responses still generating
        self.background: set[str] = set()  # ids of responses created in the background

    def start(self, response: dict, task: asyncio.Task) -> None:
        """A background response: stored now, as it stands, and finished by `task`."""
        self.put(response, [])
        self.background.add(response["id"])
        self.running[response["id"]] = task
        task.add_done_callback(lambda _: self.running.pop(response["id"], None))

    async def cancel(self, rid: str) -> dict:
        response, messages = self.get(rid)
        if rid not in self.background:
            raise bad_request("Cannot cancel a synchronous response.", "response_id")
        task = self.running.pop(rid, None)
        if task is None or task.done():
            return response  # finished already: it stays as it ended
        task.cancel()  # its generation closes, which aborts the engine request
        with contextlib.suppress(asyncio.CancelledError):
            await task
        response, messages = self.get(rid)
        if response["status"] in ("queued", "in_progress"):
            response = {**response, "status": "cancelled"}
            self.put(response, messages)
        return response

    def put(self, response: dict, messages: list[dict]) -> None:
        self._items[response["id"]] = (response, messages)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str, param: str | None = None) -> tuple[dict, list[dict]]:
        item = self._items.get(rid)
        if item is None:
            raise APIError(404, f"Response with id '{rid}' not found.", "invalid_request_error", param, "not_found")
        return item

    async def delete(self, rid: str) -> None:
        """Forgets a response; one still generating in the background is
        stopped first (as `cancel` does), so that its task cannot store it
        again and its engine request does not run on for no one."""
        self.get(rid)
        task = self.running.pop(rid, None)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._items.pop(rid, None)
        self.background.discard(rid)


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text") \
                    or not isinstance(p.get("text"), str):
                raise bad_request(f"{where}: only text content parts are supported", "input")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string or a list of text parts", "input")


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages (function calls grouped into assistant turns)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for k, it in enumerate(items):
        where = f"input[{k}]"
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}: role must be user, system, developer or assistant", "input")
            out.append({"role": role, "content": _text_of(it.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(it.get(f), str) for f in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs call_id, name and arguments", "input")
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(it.get("call_id"), str) or not isinstance(it.get("output"), str):
                raise bad_request(f"{where}: a function_call_output needs call_id and output", "input")
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", "input")
    return out


def to_chat(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request this Responses request is (after `history`, the
    stored conversation of `previous_response_id`)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history \
        + input_messages(req.input)
    body: dict = {k: v for k, v in (req.model_extra or {}).items() if k in PASSED_ON}
    body.update({"model": req.model, "messages": messages, "stream": req.stream, "seed": req.seed,
                 "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                 "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
                 "slo_ttft": req.slo_ttft, "slo_tpot": req.slo_tpot})
    fmt = (req.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
        elif kind in ("json_object", "text"):
            body["response_format"] = {"type": kind}
        else:
            raise bad_request("text.format.type must be text, json_object or json_schema", "text")
    if req.tools:
        tools = []
        for t in req.tools:
            if t.get("type") != "function":
                raise bad_request(f"tools of type {t.get('type')!r} are not supported (only function)", "tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                              "strict") if t.get(k) is not None}})
        body["tools"] = tools
    if isinstance(req.tool_choice, dict):
        if req.tool_choice.get("type") != "function" or not isinstance(req.tool_choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice["name"]}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None}, strict=False)
    except ValidationError as e:  # named as this request names it (was "1 validation error for ...", "input")
        raise bad_request(*describe_errors(e.errors(), _responses_param)) from None


def _responses_param(chat_param: str) -> str:
    """A chat request's parameter (`to_chat`) as the Responses request that made it names it."""
    head, _, rest = chat_param.partition(".")
    if head == "messages":
        return "input"
    if head == "response_format":
        return "text.format"
    if head == "tools":  # tools.K.function.X -> tools.K.X (Responses tools are flat)
        return chat_param.replace(".function", "", 1)
    if head == "tool_choice":
        return "tool_choice"
    return {"max_completion_tokens": "max_output_tokens"}.get(head, head) + (f".{rest}" if rest else "")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(req: ResponsesRequest, request: Request, client: EngineClient, store: ResponseStore):
    refuse_fields(req.model_extra, UNSUPPORTED, HARMLESS)
    if req.truncation != "disabled":
        raise bad_request("truncation 'auto' is not supported", "truncation")
    if req.background and not req.store:
        raise bad_request("background can only be used when `store` is true", "background")
    if req.background and req.stream:
        raise bad_request("background responses cannot be streamed here", "stream")
    history = []
    if req.previous_response_id:
        try:
            previous, history = store.get(req.previous_response_id, "previous_response_id")
        except APIError as e:  # a bad parameter of this request: 400, as OpenAI answers
            raise bad_request(f"Previous response with id '{req.previous_response_id}' not found.",
                              "previous_response_id") from e
        # only a finished response holds its conversation: continuing from one still running in the
        # background (or failed, or cancelled) would silently drop it
        if previous["status"] in ("queued", "in_progress"):
            raise bad_request(f"Previous response with id '{req.previous_response_id}' is still in progress.",
                              "previous_response_id")
        if previous["status"] not in ("completed", "incomplete"):
            raise bad_request(f"Previous response with id '{req.previous_response_id}' is {previous['status']}: "
                              "it has no conversation to continue from.", "previous_response_id")
    chat = to_chat(req, history)
    rid = _item_id("resp")
    created = int(time.time())
    try:
        job = await prepare_chat(chat, client)
        gen = None if req.background else await client.start(request, [job.ids], [job.params], rid, 1, job.names,
                                                             slo=(req.slo_ttft, req.slo_tpot))
    except APIError as e:  # a chat parameter at fault, as this request names it
        if e.status == 400 and e.param:
            e.param = _responses_param(e.param)
        raise
    tools = ChoiceTools(job.mode, job.choice, req.parallel_tool_calls) if job.mode != "none" else None
    msg_id = _item_id("msg")

    def response(status: str, output: list[dict], usage: dict | None, incomplete: str | None = None) -> dict:
        return {
            "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": client.settings.served_model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": req.truncation,
            "usage": usage, "user": req.user, "metadata": req.metadata or {},
        }

    def usage() -> dict:
        u = gen.acc.usage()
        # OpenAI's names, and beside them the chat names SGLang's Responses usage carries (its clients read those)
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": gen.acc.cached_tokens()},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"], "prompt_tokens": u["prompt_tokens"],
                "completion_tokens": u["completion_tokens"]}

    def message_item(text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def call_item(call) -> dict:
        return {"type": "function_call", "id": _item_id("fc"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}

    def finished(text: str, calls: list, reason: str) -> dict:
        """The whole response; stored with its conversation when `store`."""
        output = ([message_item(text)] if text or not calls else []) + [call_item(c) for c in calls]
        cut = reason == "length"
        resp = response("incomplete" if cut else "completed", output, usage(), "max_output_tokens" if cut else None)
        if req.store:
            said = {"role": "assistant", "content": text or None}
            if calls:
                said["tool_calls"] = [{"id": c.id, "type": "function",
                                       "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            store.put(resp, chat.model_dump(exclude_none=True)["messages"][1 if req.instructions else 0:] + [said])
        return resp

    def final():
        st = gen.acc.choices[0]
        text, reason = "".join(st.text), st.finish_reason
        if tools is None:
            return finished(text, [], reason)
        msg, reason = tools.message(text, reason)
        return finished(msg["content"] or "", [c for c in tools.calls], reason)

    if req.background:  # checked and prepared above; admitted and run from here on, off this request
        async def run():
            nonlocal gen
            try:
                gen = await client.start(request, [job.ids], [job.params], rid, 1, job.names,
                                         slo=(req.slo_ttft, req.slo_tpot), watch=False)
                store.put(response("in_progress", [], None), [])  # admitted: generating
                await gen.collect(watch=False)
                final()
            except asyncio.CancelledError:  # cancel: collect's own cleanup aborted the engine request
                raise
            except Exception as e:  # refused (429, the engine gone): the stored response says so
                failed = response("failed", [], None)
                if isinstance(e, APIError):
                    failed["error"] = {"code": e.code or "server_error", "message": e.message}
                else:
                    log.exception("background response %s failed", rid)
                    failed["error"] = {"code": "server_error", "message": type(e).__name__}
                store.put(failed, [])

        queued = response("queued", [], None)
        store.start(queued, asyncio.ensure_future(run()))
        return SafeJSONResponse(queued)
    if not req.stream:
        return await gen.respond(False, None, final)

    seq = iter(range(1 << 62))
    streamed: list[str] = []
    started = [False]  # the message item and its text part were announced

    def ev(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    def open_message() -> list[dict]:
        if started[0]:
            return []
        started[0] = True
        return [ev("response.output_item.added", output_index=0, item=message_item("", "in_progress")),
                ev("response.content_part.added", item_id=msg_id, output_index=0, content_index=0,
                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def text_events(delta: str) -> list[dict]:
        if not delta:
            return []
        streamed.append(delta)
        return open_message() + [ev("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                                    delta=delta, logprobs=[])]

    def chunk(out, deltas):
        events = []
        for _, o in deltas:
            reason = o.finish_reason
            if tools is None:
                events += text_events(o.text)
            else:
                parts = tools.feed(o.text) if o.text else []
                if reason is not None:
                    more, reason = tools.finish(reason)
                    parts += more
                for p in parts:  # calls are announced whole at the end
                    events += text_events(p.get("content", ""))
            if reason is None:
                continue
            text = "".join(streamed)
            calls = tools.calls if tools is not None else []
            if not text and not calls:
                events += open_message()
            resp = finished(text, calls, reason)
            if started[0]:
                item = message_item(text)
                events += [ev("response.output_text.done", item_id=msg_id, output_index=0, content_index=0, text=text,
                              logprobs=[]),
                           ev("response.content_part.done", item_id=msg_id, output_index=0, content_index=0,
                              part=item["content"][0]),
                           ev("response.output_item.done", output_index=0, item=item)]
            first = 1 if started[0] else 0
            for k, item in enumerate(resp["output"][first:], start=first):
                events += [ev("response.output_item.added", output_index=k, item={**item, "arguments": "",
                                                                                  "status": "in_progress"}),
                           ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                              delta=item["arguments"]),
                           ev("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                              arguments=item["arguments"]),
                           ev("response.output_item.done", output_index=k, item=item)]
            events.append(ev("response.incomplete" if resp["status"] == "incomplete" else "response.completed",
                             response=resp))
        return events

    opening = response("in_progress", [], None)
    first_events = [ev("response.created", response=opening), ev("response.in_progress", response=opening)]
    return await gen.respond(True, chunk, final, first_events)
