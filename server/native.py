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
import json
import time

from starlette.requests import Request

from stepserve.engine.async_engine import INLINE_TOKENIZE_CHARS
from stepserve.server.errors import bad_request
from stepserve.server.logprobs import finite_logprob, native_logprobs
from stepserve.server.protocol import SGLANG_ALIASES, GenerateRequest, Stage
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


def _sglang_finish(st) -> dict | None:
    """SGLang's `meta_info.finish_reason`: {"type": "stop", "matched": the
    stop string or token id (an end token's stop: the token itself, the
    output's last)}, {"type": "length", "length": N} or {"type": "abort",
    ...}; None while the output goes on."""
    reason = st.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(st.token_ids)}
    if reason == "stop":
        matched = st.stop_reason if st.stop_reason is not None else (st.token_ids[-1] if st.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": reason}


def _sglang_logprobs(client: EngineClient, lps, ids, with_text: bool, top: bool) -> tuple[list, list | None]:
    """SGLang's (token logprobs, top logprobs): per position [logprob, token id,
    text or None], and the alternatives at each as such lists. An entry of
    `lps` may be None (a prompt's first token): its logprob is None."""
    def entry(lp, t):
        return [None if lp is None else finite_logprob(lp), t, client.texts.text_of(t) if with_text else None]

    tokens = [entry(None if lp is None else lp.logprob, t) for lp, t in zip(lps, ids)]
    tops = [None if lp is None else [entry(v, t) for t, v in lp.top] for lp in lps] if top else None
    return tokens, tops


async def generate(req: GenerateRequest, request: Request, client: EngineClient):
    client.check_model(req.model)
    param = "text" if req.text is not None else "input_ids"
    ids = await client.tokenize(req.text, param) if req.text is not None else list(req.input_ids)
    client.check_prompt(ids, param)
    sp = req.sampling_params
    kw = sp.engine_kwargs()
    names = {k: f"sampling_params.{k}" for k in kw}
    for sglang, ours in SGLANG_ALIASES.items():  # a refusal names the field as the request named it
        if getattr(sp, sglang) is not None:
            names[ours] = f"sampling_params.{sglang}"
    if req.return_logprob:  # SGLang's logprobs: the output's, and the prompt's from logprob_start_len on
        kw["logprobs"] = req.top_logprobs_num
        if req.logprob_start_len >= 0:
            kw["prompt_logprobs"] = req.top_logprobs_num
        names |= {"logprobs": "top_logprobs_num", "prompt_logprobs": "top_logprobs_num"}
    kw["max_tokens"] = client.max_tokens(len(ids), kw["max_tokens"], None, names["max_tokens"])
    if sp.json_schema is not None:
        schema = sp.json_schema
        if isinstance(schema, str):  # SGLang sends the schema as JSON text
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise bad_request(f"json_schema is not valid JSON: {e}", "sampling_params.json_schema") from None
            if not isinstance(schema, dict):
                raise bad_request("json_schema must be a JSON object", "sampling_params.json_schema")
        kw["logits_processor_factory"] = await client.compile_schema(schema, "sampling_params.json_schema")
    elif sp.regex is not None:
        kw["logits_processor_factory"] = await asyncio.to_thread(
            client.grammar.compile_kind, "regex", sp.regex, "sampling_params.regex")
    names |= {"prompt": param, "stages": "stages"}
    params = client.sampling_params(names, **kw)
    rid = new_id("gen")
    shown_id = req.rid or rid
    stages = await _engine_stages(client, req.stages) if req.stages else None
    gen = await client.start(request, [ids], [params], rid, sp.n, names, stages, (req.slo_ttft, req.slo_tpot))
    acc = gen.acc
    want_lp = kw.get("logprobs") is not None and not req.return_logprob
    started = time.perf_counter()
    # SGLang's answer (`text`, `output_ids`, `meta_info`) beside the native one, where there is one output;
    # in a stream only for a request in SGLang's terms: each of its events carries the whole text and ids
    # so far, as SGLang's do, which a native client reading deltas would pay for in every event
    sglang = sp.n == 1 and not req.stages
    sglang_stream = sglang and req.sglang_shaped()

    def sglang_view() -> dict:
        st = acc.choices.get(0)
        text, out_ids = ("".join(st.text), st.token_ids) if st is not None else ("", [])
        meta = {"id": shown_id, "finish_reason": _sglang_finish(st) if st is not None else None,
                "prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                "cached_tokens": acc.cached_tokens(), "e2e_latency": time.perf_counter() - started}
        if req.return_logprob:
            top = req.top_logprobs_num > 0
            meta["output_token_logprobs"], tops = _sglang_logprobs(
                client, st.logprobs if st is not None else [], out_ids, req.return_text_in_logprobs, top)
            if top:
                meta["output_top_logprobs"] = tops
            plp = acc.prompt_logprobs.get(0)
            if req.logprob_start_len >= 0 and plp is not None:
                start = min(req.logprob_start_len, len(ids))
                lps = [None] + list(plp[1:])
                meta["input_token_logprobs"], tops = _sglang_logprobs(
                    client, lps[start:], ids[start:], req.return_text_in_logprobs, top)
                if top:
                    meta["input_top_logprobs"] = tops
        return {"text": text, "output_ids": list(out_ids), "meta_info": meta}

    def chunk(out, deltas):
        msg = {"id": shown_id, "outputs": [_output(o, want_lp) for o in out.outputs]}
        if out.prompt_logprobs is not None and not req.return_logprob:
            msg["prompt_logprobs"] = _prompt_logprobs(out.prompt_logprobs)
        if out.finished:
            msg["usage"] = acc.usage()
        if sglang_stream:  # SGLang's stream: the text and ids so far
            msg |= sglang_view()
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
        body = {"id": shown_id, "prompt_token_ids": ids,
                "prompt_logprobs": _prompt_logprobs(plp) if plp and not req.return_logprob else None,
                "outputs": outputs, "usage": acc.usage()}
        return body | sglang_view() if sglang else body

    return await gen.respond(req.stream, chunk, final)
