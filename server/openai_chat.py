"""`POST /v1/chat/completions`: messages rendered with the model's chat template."""

from __future__ import annotations

import asyncio
import functools

from starlette.requests import Request

from stepserve.server.errors import bad_request
from stepserve.server.logprobs import chat_logprobs
from stepserve.server.openai_common import sampling_kwargs, stream_usage
from stepserve.server.protocol import ChatCompletionRequest
from stepserve.server.serving import INLINE_TOKENIZE_CHARS, EngineClient, new_id


async def render_chat(client: EngineClient, req: ChatCompletionRequest) -> list[int]:
    """The conversation through the chat template, tokenized; its length is
    checked before either, and big ones are rendered off the event loop."""
    tok = client.tokenizer
    if not getattr(tok, "chat_template", None):
        raise bad_request("This model has no chat template; use /v1/completions", "messages")
    messages = []
    for m in req.messages:
        msg = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    chars = sum(len(m["content"]) for m in messages)
    client.check_text_length(chars, "messages")  # the template adds text; it does not drop a turn's content
    render = functools.partial(tok.apply_chat_template, messages, tokenize=False,
                               add_generation_prompt=req.add_generation_prompt)
    try:
        text = render() if chars <= INLINE_TOKENIZE_CHARS else await asyncio.to_thread(render)
    except Exception as e:  # jinja raises for conversations the template refuses
        raise bad_request(f"The chat template cannot render these messages: {e}", "messages") from None
    # the rendered template already holds its special tokens as text
    return await client.tokenize(text, "messages")


async def create_chat_completion(req: ChatCompletionRequest, request: Request, client: EngineClient):
    client.check_model(req.model)
    kw = sampling_kwargs(req, "chat")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    ids = await render_chat(client, req)
    client.check_prompt(ids, "messages")
    budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = client.max_tokens(len(ids), requested, None, budget_param)
    factory = await client.compile_grammar(req.response_format)
    names = {"logprobs": "top_logprobs", "max_tokens": budget_param, "prompt": "messages"}
    params = client.sampling_params(
        names,
        **kw,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        logits_processor_factory=factory,
    )
    rid = new_id("chatcmpl")
    gen = await client.start(request, [ids], [params], rid, req.n, names, slo=(req.slo_ttft, req.slo_tpot))
    acc = gen.acc

    def head(obj: str, choices, **extra):
        return {"id": rid, "object": obj, "created": acc.created, "model": client.settings.served_model_name,
                "system_fingerprint": None, "choices": choices, **extra}

    include_usage, continuous = stream_usage(req)
    extra = {"usage": None} if include_usage else {}
    chunk_obj = "chat.completion.chunk"

    def live():  # the usage field of a streamed chunk: the running totals with continuous_usage_stats
        return {"usage": acc.usage()} if continuous else extra

    def chunk(out, deltas):
        events = []
        for idx, o in deltas:  # one choice per chunk, as OpenAI streams them
            if not o.text and not o.token_ids and o.finish_reason is None:
                continue
            lp = chat_logprobs(client.texts, o.logprobs or []) if req.logprobs else None
            delta = {"content": o.text} if o.text else {}
            choice = {"index": idx, "delta": delta, "logprobs": lp, "finish_reason": o.finish_reason}
            if o.finish_reason is not None:
                choice["stop_reason"] = o.stop_reason
            events.append(head(chunk_obj, [choice], **live()))
        return events

    def final():
        choices = [
            {
                "index": idx,
                "message": {"role": "assistant", "content": "".join(st.text), "refusal": None},
                "logprobs": chat_logprobs(client.texts, st.logprobs) if req.logprobs else None,
                "finish_reason": st.finish_reason,
                "stop_reason": st.stop_reason,
            }
            for idx, st in sorted(acc.choices.items())
        ]
        return head("chat.completion", choices, usage=acc.usage())

    first = [head(chunk_obj, [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], **extra) for i in range(req.n)]
    last = (lambda: head(chunk_obj, [], usage=acc.usage())) if include_usage else None
    return await gen.respond(req.stream, chunk, final, first, last)
