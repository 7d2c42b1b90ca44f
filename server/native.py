"""`POST /generate`: the native route for tools that need exact tokens.

In: `text` or `input_ids`, and `sampling_params` in the engine's own names.
Out: `{"id", "prompt_token_ids", "prompt_logprobs", "outputs": [{"index",
"stage", "text", "token_ids", "finish_reason", "stop_reason", "logprobs"}],
"usage"}`; streamed, each event carries only the new text and tokens (the
first one with a token also the prompt logprobs, when asked for), and the last
one the usage. `prompt_logprobs` has an entry per prompt token, null for the
first.

`stages` makes a fork/join request: after the first stage (the prompt and
`sampling_params.max_tokens`, n = 1), each stage is `{"max_tokens": N}`
(serial: generation goes on) or `{"branches": [{"prompt": SUFFIX,
"max_tokens": N}, ...]}` (parallel: each branch continues from everything so
far plus its own suffix, text or token ids; a text is checked and tokenized
here, as the prompt is); after a parallel stage the context is everything
before it plus each branch's output in order. Every branch of every stage is
an output, `index` in order, `stage` its stage.
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from stepserve.engine.async_engine import INLINE_TOKENIZE_CHARS
from stepserve.server.logprobs import native_logprobs
from stepserve.server.protocol import GenerateRequest, Stage
from stepserve.server.serving import EngineClient, new_id


def _output(o, logprobs: bool) -> dict:
    return {
        "index": o.index,
        "stage": o.stage,
        "text": o.text,
        "token_ids": list(o.token_ids),
        "finish_reason": o.finish_reason,
        "stop_reason": o.stop_reason,
        "logprobs": native_logprobs(o.logprobs or []) if logprobs else None,
    }


def _prompt_logprobs(lps) -> list:
    return [None] + native_logprobs(lps[1:])


async def _engine_stages(client: EngineClient, stages: list[Stage]) -> list[dict]:
    """The stages in the engine's form, with each branch's text suffix checked
    for length and tokenized here, as a prompt is (off the event loop when the
    texts are long): left to the engine, they were tokenized on its own loop,
    stalling every request in flight (7.8 MB of suffixes held it 14 s), only
    for most of them to be refused."""
    out = [st.engine_dict() for st in stages]
    texts = []  # [(branch dict, text)] of every text suffix
    for k, st in enumerate(out):
        for b, br in enumerate(st.get("branches", ())):
            if isinstance(br["prompt"], str):  # every length is checked before any text is tokenized
                client.check_text_length(len(br["prompt"]), f"stages.{k}.branches.{b}.prompt")
                texts.append((br, br["prompt"]))

    def encode() -> list[list[int]]:
        return [client.tokenizer.encode(t, add_special_tokens=False) if t else [] for _, t in texts]

    inline = sum(len(t) for _, t in texts) <= INLINE_TOKENIZE_CHARS
    for (br, _), ids in zip(texts, encode() if inline else await asyncio.to_thread(encode)):
        br["prompt"] = ids
    return out


async def generate(req: GenerateRequest, request: Request, client: EngineClient):
    client.check_model(req.model)
    param = "text" if req.text is not None else "input_ids"
    ids = await client.tokenize(req.text, param) if req.text is not None else list(req.input_ids)
    client.check_prompt(ids, param)
    sp = req.sampling_params
    kw = sp.model_dump(exclude={"json_schema"})
    kw["max_tokens"] = client.max_tokens(len(ids), sp.max_tokens, None, "sampling_params.max_tokens")
    if sp.json_schema is not None:
        kw["logits_processor_factory"] = await client.compile_schema(sp.json_schema, "sampling_params.json_schema")
    names = {k: f"sampling_params.{k}" for k in kw} | {"prompt": param, "stages": "stages"}
    params = client.sampling_params(names, **kw)
    rid = new_id("gen")
    stages = await _engine_stages(client, req.stages) if req.stages else None
    gen = await client.start(request, [ids], [params], rid, sp.n, names, stages, (req.slo_ttft, req.slo_tpot))
    acc = gen.acc
    want_lp = sp.logprobs is not None

    def chunk(out, deltas):
        msg = {"id": rid, "outputs": [_output(o, want_lp) for o in out.outputs]}
        if out.prompt_logprobs is not None:
            msg["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
        if out.finished:
            msg["usage"] = acc.usage()
        return msg

    def final():
        outputs = [
            {
                "index": idx,
                "stage": st.stage,
                "text": "".join(st.text),
                "token_ids": st.token_ids,
                "finish_reason": st.finish_reason,
                "stop_reason": st.stop_reason,
                "logprobs": native_logprobs(st.logprobs) if want_lp else None,
            }
            for idx, st in sorted(acc.choices.items())
        ]
        plp = acc.prompt_logprobs.get(0)
        return {"id": rid, "prompt_token_ids": ids, "prompt_logprobs": _prompt_logprobs(plp) if plp else None,
                "outputs": outputs, "usage": acc.usage()}

    return await gen.respond(req.stream, chunk, final)
