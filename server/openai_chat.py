"""`POST /v1/chat/completions`: messages rendered with the model's chat template."""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass

from starlette.requests import Request

from stepserve.engine.async_engine import INLINE_TOKENIZE_CHARS
from stepserve.server.errors import bad_request
from stepserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from stepserve.server.openai_common import chunk_usage, include_usage, output_grammar, sampling_kwargs
from stepserve.server.protocol import ChatCompletionRequest
from stepserve.server.serving import EngineClient, new_id
from stepserve.server.tools import ChoiceTools, constrained_schema


# conversations of up to this many messages (and INLINE_TOKENIZE_CHARS of text) are rendered inline
INLINE_RENDER_MESSAGES = 64


def _arguments(text: str):
    """A call's arguments as the chat template wants them: the parsed object
    (templates write `arguments | tojson`), or the text if it is not JSON (or
    is nested deeper than the parser goes: that raised RecursionError, a 500)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


async def render_chat(client: EngineClient, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
    """The conversation through the chat template (with `tools`, which it must
    render), tokenized; its length is checked before either, and big ones are
    rendered off the event loop."""
    tok = client.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions", "messages")
    texts = [m.text() for m in req.messages]
    chars = sum(map(len, texts)) + sum(len(c.function.arguments) for m in req.messages for c in (m.tool_calls or ()))
    client.check_text_length(chars, "messages")  # the template adds text; it does not drop a turn's content
    messages = []
    for m, content in zip(req.messages, texts):
        msg = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        messages.append(msg)
    add_generation_prompt = req.add_generation_prompt
    if req.continue_final_message:
        # continuing the last message implies no generation prompt after it (SGLang's reading; vLLM refuses
        # only a request that sets both itself): only an explicit add_generation_prompt=true conflicts
        if "add_generation_prompt" not in req.model_fields_set:
            add_generation_prompt = False
        elif add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              "continue_final_message")
    extra = dict(req.chat_template_kwargs or {})
    taken = sorted(set(extra) & {"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict"})
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
    render = functools.partial(tok.apply_chat_template, messages, tokenize=False,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=req.continue_final_message, **extra)

    def rendered() -> tuple[str, bool]:
        """(the prompt text, whether the template ignored `tools`)."""
        if not tools:
            return render(), False
        text = render(tools=tools)
        return text, text == render()

    # the template's cost grows with the messages as well as their text: 200,000 empty messages took
    # a second of the event loop, so a conversation of many messages is rendered off it too
    inline = chars <= INLINE_TOKENIZE_CHARS and len(messages) <= INLINE_RENDER_MESSAGES
    try:
        text, blind = rendered() if inline else await asyncio.to_thread(rendered)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise bad_request(f"The chat template cannot render these messages: {e}", "messages") from None
    if blind:  # a template that ignores `tools` would let the model answer blind: refuse instead
        raise bad_request("This model's chat template does not render tools", "tools")
    # the rendered template already holds its special tokens as text (vLLM's add_special_tokens adds the
    # tokenizer's on top, for a template that leaves them out)
    return await client.tokenize(text, "messages", req.add_special_tokens)


def tool_mode(req: ChatCompletionRequest) -> tuple[str, object]:
    """("none" | "auto" | "required" | "named", tool_choice as plain data),
    after checking that the choice fits the request."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if not isinstance(choice, str):
        choice = choice.model_dump()
        if not req.tools or choice["function"]["name"] not in {t.function.name for t in req.tools}:
            raise bad_request(f"tool_choice names function {choice['function']['name']!r}, which is not "
                              "among the request's tools", "tool_choice")
        mode = "named"
    else:
        mode = choice
        if mode == "required" and not req.tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
    if mode in ("required", "named"):
        try:
            c = req.constraint()
        except ValueError:
            c = (None, None, "structured_outputs")
        if c is not None:
            raise bad_request(f"{c[2]} cannot be combined with a tool_choice that forces a call", c[2])
    return mode, choice


@dataclass
class ChatJob:
    """A chat request made ready for the engine: its prompt, sampling
    parameters and tool mode (shared by chat completions and the Responses API)."""

    ids: list[int]
    params: object  # SamplingParams
    names: dict[str, str]
    mode: str  # tool mode: none | auto | required | named
    choice: object  # tool_choice as plain data
    echo: str  # vLLM's echo: the text the answer starts with


async def prepare_chat(req: ChatCompletionRequest, client: EngineClient) -> ChatJob:
    """Checks, renders and tokenizes a chat request and builds its sampling
    parameters (a 400 naming the field for anything wrong)."""
    client.check_model(req.model)
    kw = sampling_kwargs(req, "chat")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    mode, choice = tool_mode(req)
    # vLLM's echo: the last message's content, when it is the assistant's (a continued answer)
    last_msg = req.messages[-1]
    echo = last_msg.text() if req.echo and last_msg.role == "assistant" else ""
    if echo and mode != "none":
        raise bad_request("echo cannot be combined with tool calls", "echo")
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and mode != "none" else None
    ids = await render_chat(client, req, tools)
    if req.truncate_prompt_tokens is not None:
        ids = ids[-req.truncate_prompt_tokens:]  # vLLM's extension: the rendered prompt's last N tokens
    client.check_prompt(ids, "messages")
    budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = client.max_tokens(len(ids), requested, None, budget_param)
    schema = constrained_schema(tools, choice) if mode in ("required", "named") else None
    if schema is not None and mode == "required" and not req.parallel_tool_calls:
        schema = {**schema, "maxItems": 1}
    factory = await (client.compile_schema(schema, "tools") if schema is not None else output_grammar(client, req))
    names = {"logprobs": "top_logprobs", "max_tokens": budget_param, "prompt": "messages"}
    params = client.sampling_params(
        names,
        **kw,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        logits_processor_factory=factory,
    )
    return ChatJob(ids, params, names, mode, choice, echo)


async def create_chat_completion(req: ChatCompletionRequest, request: Request, client: EngineClient):
    job = await prepare_chat(req, client)
    ids, params, names, mode, choice = job.ids, job.params, job.names, job.mode, job.choice
    rid = new_id("chatcmpl")
    gen = await client.start(request, [ids], [params], rid, req.n, names, slo=(req.slo_ttft, req.slo_tpot))
    acc = gen.acc

    def head(obj: str, choices, **extra):
        return {"id": rid, "object": obj, "created": acc.created, "model": client.settings.served_model_name,
                "system_fingerprint": None, "choices": choices, **extra}

    chunk_obj = "chat.completion.chunk"
    per_choice: dict[int, ChoiceTools] = {}
    echo = job.echo

    def chunk(out, deltas):
        events = []
        for idx, o in deltas:  # one choice per chunk, as OpenAI streams them
            if not o.text and not o.token_ids and o.finish_reason is None:
                continue
            lp = chat_logprobs(client.texts, o.logprobs or []) if req.logprobs else None
            reason = o.finish_reason
            if mode == "none":
                parts = [{"content": o.text}] if o.text else [{}]
            else:
                ct = per_choice.setdefault(idx, ChoiceTools(mode, choice, req.parallel_tool_calls))
                parts = ct.feed(o.text) if o.text else []
                if reason is not None:
                    more, reason = ct.finish(reason)
                    parts += more
                elif not parts:
                    continue  # text held back (a tool call in the making)
                parts = parts or [{}]
            for k, delta in enumerate(parts):
                last = k == len(parts) - 1
                c = {"index": idx, "delta": delta, "logprobs": lp if k == 0 else None,
                     "finish_reason": reason if last else None}
                if last and reason is not None:
                    c["stop_reason"] = o.stop_reason
                events.append(head(chunk_obj, [c], **chunk_usage(req, acc)))
        return events

    def final():
        choices = []
        for idx, st in sorted(acc.choices.items()):
            text, reason = echo + "".join(st.text), st.finish_reason
            msg = {"content": text}
            if mode != "none":
                msg, reason = ChoiceTools(mode, choice, req.parallel_tool_calls).message(text, reason)
            choices.append({
                "index": idx,
                "message": {"role": "assistant", **msg, "refusal": None},
                "logprobs": chat_logprobs(client.texts, st.logprobs) if req.logprobs else None,
                "finish_reason": reason,
                "stop_reason": st.stop_reason,
            })
        plp = vllm_prompt_logprobs(client.texts, acc.prompt_logprobs[0]) if req.prompt_logprobs is not None else None
        return head("chat.completion", choices, usage=acc.usage(), prompt_logprobs=plp)

    first = [head(chunk_obj, [{"index": i, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                               "finish_reason": None}], **chunk_usage(req, acc)) for i in range(req.n)]
    last = (lambda: head(chunk_obj, [], usage=acc.usage())) if include_usage(req) else None
    return await gen.respond(req.stream, chunk, final, first, last)
