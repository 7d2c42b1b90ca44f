"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's or a
conversation's token ids as the generation routes would make them, and
token ids back to text. Clients count and truncate prompts with them."""

from __future__ import annotations

from stepserve.server.errors import SafeJSONResponse, bad_request
from stepserve.server.openai_chat import render_chat
from stepserve.server.openai_common import refuse_fields
from stepserve.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from stepserve.server.serving import EngineClient

# vLLM's tokenize fields that stepserve does not implement and that would change the tokens
_UNSUPPORTED = {"chat_template": "a chat template in the request", "mm_processor_kwargs": "multimodal inputs",
                "media_io_kwargs": "multimodal inputs", "documents": "documents for the chat template"}
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


async def tokenize(req: TokenizeRequest, client: EngineClient) -> SafeJSONResponse:
    """`prompt` is tokenized as /v1/completions tokenizes a text (the
    tokenizer's special tokens unless add_special_tokens is false);
    `messages` as /v1/chat/completions renders them (the template, with
    `tools`, then no special tokens of the tokenizer's unless asked)."""
    client.check_model(req.model)
    refuse_fields(req.model_extra, _UNSUPPORTED, {})
    if req.prompt is not None:
        given = sorted(set(_CHAT_ONLY) & req.model_fields_set)
        if given:
            raise bad_request(f"{given[0]} applies to messages, not to a prompt", given[0])
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await client.tokenize(req.prompt, "prompt", special)
    else:
        fields = {k: getattr(req, k) for k in ("messages", *_CHAT_ONLY) if k in req.model_fields_set}
        if req.add_special_tokens is not None:
            fields["add_special_tokens"] = req.add_special_tokens
        chat = ChatCompletionRequest.model_validate(fields)
        tools = [t.model_dump(exclude_none=True) for t in chat.tools] if chat.tools else None
        ids = await render_chat(client, chat, tools)
    body = {"count": len(ids), "max_model_len": client.max_model_len, "tokens": ids}
    body["token_strs"] = client.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return SafeJSONResponse(body)


async def detokenize(req: DetokenizeRequest, client: EngineClient) -> SafeJSONResponse:
    """The text of `tokens`, special tokens included (as vLLM decodes them)."""
    client.check_model(req.model)
    bad = [t for t in req.tokens if t >= client.vocab_size]
    if bad:
        raise bad_request(f"tokens {bad[:5]} are outside the vocabulary of {client.vocab_size}", "tokens")
    return SafeJSONResponse({"prompt": client.tokenizer.decode(req.tokens)})
