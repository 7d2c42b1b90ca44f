"""The OpenAI-compatible server through the official `openai` client (sync and
async) against a real uvicorn server on 127.0.0.1: parameters, streaming,
n > 1, logprobs, usage, echo, stops, structured output, the native route,
metrics, and cancellation."""

import asyncio
import json
import re
import sys

import httpx
import openai
import pytest

from server_util import server_fixtures

MODEL = "test-model"
KEY = "sk-test-key"


srv, client = server_fixtures(MODEL, KEY, kv_slots=16384, max_running=64, enable_prompt_tokens_details=True)


@pytest.fixture(scope="module")
def tok(srv):
    return srv.engine.tokenizer


def run(coro):
    return asyncio.run(coro)


def aclient(srv):
    return openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def complete(client, prompt="In the beginning", **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


def stream_texts(chunks):
    """Concatenated text and finish reasons per choice index of a completions stream."""
    texts, reasons = {}, {}
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    return texts, reasons


# -- basics -------------------------------------------------------------------


def test_models_health_and_routes(srv, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}  # no key needed


def test_completion_usage_matches_tokenizer_and_native_route(srv, client, tok):
    prompt = "The quick brown fox"
    r = complete(client, prompt, max_tokens=10, seed=5, temperature=0.9, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert r.usage.completion_tokens == 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + 10
    assert r.choices[0].finish_reason == "length" and r.choices[0].index == 0
    # the native route gives the exact tokens of the same generation
    g = httpx.post(srv.url + "/generate", headers=srv.headers(), timeout=60, json={
        "text": prompt, "sampling_params": {"max_tokens": 10, "seed": 5, "temperature": 0.9, "ignore_eos": True}}).json()
    out = g["outputs"][0]
    assert g["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    assert len(out["token_ids"]) == 10 and out["finish_reason"] == "length"
    assert out["text"] == r.choices[0].text == tok.decode(out["token_ids"], skip_special_tokens=True)
    # token ids in give the same as text in
    g2 = httpx.post(srv.url + "/generate", headers=srv.headers(), timeout=60, json={
        "input_ids": g["prompt_token_ids"],
        "sampling_params": {"max_tokens": 10, "seed": 5, "temperature": 0.9, "ignore_eos": True}}).json()
    assert g2["outputs"][0]["token_ids"] == out["token_ids"]
    assert g2["usage"]["prompt_tokens"] == len(g["prompt_token_ids"]) and g2["usage"]["completion_tokens"] == 10


def test_prompt_forms_and_n(srv, client, tok):
    ids = tok.encode("And the earth", add_special_tokens=False)
    text = complete(client, "And the earth", max_tokens=6, seed=1).choices[0].text
    assert complete(client, ids, max_tokens=6, seed=1).choices[0].text == text
    r = complete(client, ["And the earth", "In the beginning"], max_tokens=6, seed=1, n=2, temperature=1.0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == len(ids) + len(tok.encode("In the beginning", add_special_tokens=False))
    assert r.choices[0].text != r.choices[1].text or r.choices[2].text != r.choices[3].text  # distinct branches
    r2 = complete(client, [ids, ids], max_tokens=6, seed=1)
    assert [c.index for c in r2.choices] == [0, 1] and r2.choices[0].text == r2.choices[1].text == text


def test_n_branches_are_distinct_and_reproducible(client):
    kw = dict(max_tokens=16, n=3, seed=123, temperature=1.0, extra_body={"ignore_eos": True})
    a = complete(client, "Once", **kw)
    b = complete(client, "Once", **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert len({c.text for c in a.choices}) == 3
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 48


def test_stream_equals_non_stream_completions(client):
    kw = dict(prompt=["In the beginning", "darkness was"], max_tokens=20, n=2, seed=7, temperature=1.0,
              top_p=0.95, extra_body={"min_p": 0.01, "top_k": 50})
    whole = complete(client, **kw)
    chunks = list(complete(client, stream=True, **kw))
    texts, reasons = stream_texts(chunks)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: [c.finish_reason] for c in whole.choices}  # exactly one per choice


def test_stream_equals_non_stream_chat_async(srv):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me of the earth."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=20, n=2, seed=9, temperature=0.8)

    async def go():
        async with aclient(srv) as c:
            whole = await c.chat.completions.create(**kw)
            stream = await c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
            chunks = [ch async for ch in stream]
            return whole, chunks

    whole, chunks = run(go())
    texts, reasons, roles = {}, {}, {}
    for ch in chunks[:-1]:
        assert ch.object == "chat.completion.chunk" and ch.usage is None
        for c in ch.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons.setdefault(c.index, []).append(c.finish_reason)
    assert roles == {0: "assistant", 1: "assistant"}
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: [c.finish_reason] for c in whole.choices}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens


def test_include_usage_completions(client):
    chunks = list(complete(client, max_tokens=5, stream=True, stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True}))
    assert all(ch.usage is None for ch in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    plain = list(complete(client, max_tokens=5, stream=True))
    assert all(ch.choices for ch in plain)


# -- sampling parameters --------------------------------------------------------


def test_greedy_seed_and_top_k(client):
    g1 = complete(client, temperature=0, max_tokens=16).choices[0].text
    g2 = complete(client, temperature=0.7, max_tokens=16, seed=3, extra_body={"top_k": 1}).choices[0].text
    g3 = complete(client, temperature=1.0, top_p=0.0, max_tokens=16, seed=4).choices[0].text  # top_p 0 = argmax
    assert g1 == g2 == g3
    s1 = complete(client, temperature=1.0, seed=11, max_tokens=16).choices[0].text
    assert complete(client, temperature=1.0, seed=11, max_tokens=16).choices[0].text == s1
    assert complete(client, temperature=1.0, seed=12, max_tokens=16).choices[0].text != s1


def test_logit_bias_and_penalties(srv, client, tok):
    target = tok.encode(" the", add_special_tokens=False)
    assert len(target) == 1
    r = complete(client, max_tokens=6, logit_bias={str(target[0]): 100}, temperature=1.0, seed=1)
    assert r.choices[0].text == " the" * 6
    base = complete(client, temperature=0, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=5.0)):
        r = complete(client, temperature=0, max_tokens=24, extra_body={"ignore_eos": True, **kw})
        assert r.choices[0].text != base, kw  # each penalty changes the greedy path


def test_user_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=5, user="alice", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant"


def test_stop_strings_and_holdback(client):
    kw = dict(temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
    full = complete(client, **kw).choices[0].text
    k = max(3, len(full) // 2)
    stop = full[k:k + 3]
    cut = full[: full.index(stop)]
    r = complete(client, stop=stop, **kw)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    texts, reasons = stream_texts(complete(client, stop=[stop, "\x00never"], stream=True, **kw))
    assert texts[0] == cut and reasons[0] == ["stop"]
    # a stop whose beginning appears but never completes: held back, then released at the end
    partial = full[k:k + 2] + "\x01\x02"
    texts, reasons = stream_texts(complete(client, stop=partial, stream=True, **kw))
    assert texts[0] == full and reasons[0] == ["length"]
    # chat: the stop string never reaches the client
    msgs = [{"role": "user", "content": "Speak"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, **kw).choices[0].message.content
    stop = whole[len(whole) // 2: len(whole) // 2 + 2]
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, stop=[stop], stream=True, **kw)
    got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got == whole[: whole.index(stop)]


def test_echo(client, tok):
    r = complete(client, "In the beginning", echo=True, max_tokens=5, seed=2)
    plain = complete(client, "In the beginning", max_tokens=5, seed=2)
    assert r.choices[0].text == "In the beginning" + plain.choices[0].text
    ids = tok.encode("In the beginning", add_special_tokens=False)
    texts, _ = stream_texts(complete(client, ids, echo=True, max_tokens=5, seed=2, stream=True))
    assert texts[0] == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(srv, client, tok, llama_ckpt):
    """echo + logprobs: the prompt's tokens come first in the choice's
    logprobs (the first with null logprob), equal to transformers' on the
    same weights, then the completion's, as without echo; streamed, the echo
    is its own first event. The prompt is recomputed even when cached."""
    import torch
    from transformers import AutoModelForCausalLM

    text = "In the beginning God created"
    ids = tok.encode(text, add_special_tokens=False)
    complete(client, ids, max_tokens=1)  # cache the prompt
    r = complete(client, ids, echo=True, logprobs=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = complete(client, ids, logprobs=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[n] == len(r.choices[0].text) - len(plain.choices[0].text)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    hf = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [ref[i - 1, ids[i]].item() for i in range(1, n)]
    assert lp.token_logprobs[1:n] == pytest.approx(want, abs=2e-3)
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:n])

    chunks = list(complete(client, ids, echo=True, logprobs=2, max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
                           stream=True))
    assert chunks[0].choices[0].text == text and len(chunks[0].choices[0].logprobs.tokens) == n
    streamed = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-5)
    g = httpx.post(srv.url + "/generate", headers=srv.headers(), timeout=60,
                   json={"input_ids": ids, "sampling_params": {"max_tokens": 2, "prompt_logprobs": 1}}).json()
    assert g["prompt_logprobs"][0] is None and len(g["prompt_logprobs"]) == n
    assert [e["logprob"] for e in g["prompt_logprobs"][1:]] == pytest.approx(lp.token_logprobs[1:n], abs=1e-5)


def test_cached_tokens_from_radix_cache(client, tok):
    prompt = "In the beginning God created the heaven and the earth, " * 3 + "and then"
    plen = len(tok.encode(prompt, add_special_tokens=False))
    complete(client, prompt, max_tokens=2)
    r = complete(client, prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == plen - 1  # all but the last prompt token


def test_chat_usage_matches_template(client, tok):
    msgs = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello"}]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3)
    rendered = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello"}]
    ids = tok.apply_chat_template(rendered, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert r.usage.prompt_tokens == len(ids)
    assert r.object == "chat.completion"


# -- logprobs -------------------------------------------------------------------


def test_completion_logprobs_format(client):
    r = complete(client, max_tokens=8, logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for tok_s, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tok_lp <= 0 and 1 <= len(top) <= 4
        assert top[tok_s] == tok_lp and tok_lp == max(top.values())  # greedy: the sampled token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # streamed logprobs are the same, chunk by chunk
    chunks = list(complete(client, max_tokens=8, logprobs=3, temperature=0, stream=True,
                           extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    zero = complete(client, max_tokens=4, logprobs=0, temperature=0, extra_body={"ignore_eos": True})
    assert all(len(t) == 1 for t in zero.choices[0].logprobs.top_logprobs)


def test_chat_logprobs_format(client):
    msgs = [{"role": "user", "content": "Ünïcödé café"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, logprobs=True, top_logprobs=2,
                                       temperature=0, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 12 == r.usage.completion_tokens
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.logprob == e.top_logprobs[0].logprob  # greedy
        assert all(isinstance(b, int) for b in e.bytes)
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    assert client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3).choices[0].logprobs is None


# -- structured output -------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "alive": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "alive", "color", "tags"],
    "additionalProperties": False,
}


def _check_schema(obj):
    assert isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 150
    assert isinstance(obj["alive"], bool) and obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 5 for t in obj["tags"])


def test_json_schema_response_format(srv, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, n=2, seed=3, temperature=1.0,
                                       response_format=fmt)
    for c in r.choices:
        assert c.finish_reason == "stop"
        _check_schema(json.loads(c.message.content))
    # streamed, and through completions
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, seed=3, temperature=1.0,
                                            response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    rc = complete(client, "Person:", max_tokens=200, seed=5, extra_body={"response_format": fmt})
    _check_schema(json.loads(rc.choices[0].text))


def test_json_object_response_format(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=300, seed=1, temperature=0.7,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


# -- native route ----------------------------------------------------------------


def test_generate_stream_and_stop_token_ids(srv, tok):
    sp = {"max_tokens": 12, "seed": 4, "temperature": 1.0, "n": 2, "logprobs": 1, "ignore_eos": True}
    whole = httpx.post(srv.url + "/generate", headers=srv.headers(), timeout=60,
                       json={"text": "hello", "sampling_params": sp}).json()
    toks, texts, usage = {}, {}, None
    with httpx.stream("POST", srv.url + "/generate", headers=srv.headers(), timeout=60,
                      json={"text": "hello", "sampling_params": sp, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        msg = json.loads(ln[6:])
        for o in msg["outputs"]:
            toks.setdefault(o["index"], []).extend(o["token_ids"])
            texts[o["index"]] = texts.get(o["index"], "") + o["text"]
        usage = msg.get("usage", usage)
    for o in whole["outputs"]:
        assert toks[o["index"]] == o["token_ids"] and texts[o["index"]] == o["text"]
        assert len(o["logprobs"]) == 12 and all(len(e["top"]) == 1 for e in o["logprobs"])
    assert usage["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 24
    stop_tok = whole["outputs"][0]["token_ids"][3]
    sp = {"max_tokens": 12, "seed": 4, "temperature": 1.0, "stop_token_ids": [stop_tok]}
    g = httpx.post(srv.url + "/generate", headers=srv.headers(), timeout=60,
                   json={"text": "hello", "sampling_params": sp}).json()["outputs"][0]
    assert g["finish_reason"] == "stop" and g["stop_reason"] == stop_tok and g["token_ids"][-1] == stop_tok


# -- cancellation and metrics --------------------------------------------------------


def test_cancel_many_streams_then_prompt_answer(srv):
    before = srv.metrics()['stepserve:requests_total{finished_reason="abort"}']

    async def go():
        async with aclient(srv) as c:
            async def one(i):
                prompt = f"cancel me {i}" if i % 2 else [f"cancel me {i}", f"and me {i}"]  # merged streams too
                s = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=400, stream=True,
                                               n=1 + i % 3 // 2, extra_body={"ignore_eos": True})
                async for _ in s:
                    break
                await s.close()  # the client goes away mid-stream

            await asyncio.gather(*(one(i) for i in range(16)))
            r = await c.completions.create(model=MODEL, prompt="still there?", max_tokens=4)
            return r

    r = run(go())
    assert r.choices[0].finish_reason in ("stop", "length")
    srv.wait_idle()
    srv.assert_kv_clean()
    m = srv.metrics()
    aborted = sum((1 if i % 2 else 2) * (1 + i % 3 // 2) for i in range(16))  # prompts x n
    assert m['stepserve:requests_total{finished_reason="abort"}'] - before == aborted
    assert m["stepserve:num_requests_running"] == 0 and m["stepserve:kv_cache_usage_perc"] == 0


def test_non_streaming_disconnect_releases_the_request(srv):
    import time

    m0 = srv.metrics()
    srv.engine.pause()  # hold the engine: the request cannot finish first
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", headers=srv.headers(), timeout=httpx.Timeout(60, read=1.0),
                       json={"model": MODEL, "prompt": "slow", "max_tokens": 300})
        # the server notices the disconnect by itself, while the engine is still held
        while srv.app.state.client.admission.in_flight:
            time.sleep(0.01)
    finally:
        srv.engine.resume()
    srv.wait_idle()
    srv.assert_kv_clean()
    m1 = srv.metrics()
    assert m1['stepserve:requests_total{finished_reason="length"}'] == m0['stepserve:requests_total{finished_reason="length"}']
    assert m1["stepserve:generation_tokens_total"] == m0["stepserve:generation_tokens_total"]


def test_metrics_count_what_was_sent(srv, client):
    srv.wait_idle()
    m0 = srv.metrics()
    sent = [complete(client, f"metrics {i} " * (i + 1), max_tokens=3 + i, extra_body={"ignore_eos": True})
            for i in range(4)]
    sent.append(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}],
                                               max_tokens=5, n=2, extra_body={"ignore_eos": True}))
    srv.wait_idle()
    m1 = srv.metrics()

    def d(name):
        return m1.get(name, 0) - m0.get(name, 0)

    assert d('stepserve:requests_total{finished_reason="length"}') == 6  # one per choice
    assert d('stepserve:requests_total{finished_reason="stop"}') == 0
    assert d("stepserve:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in sent)
    assert d("stepserve:generation_tokens_total") == sum(r.usage.completion_tokens for r in sent)
    assert d("stepserve:prefix_cache_queried_tokens_total") == sum(r.usage.prompt_tokens for r in sent)
    assert d("stepserve:prefix_cache_hit_tokens_total") == sum(r.usage.prompt_tokens_details.cached_tokens
                                                              for r in sent)
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert d(f"stepserve:{h}_count") == 5
    assert d("stepserve:step_time_seconds_count") >= max(r.usage.completion_tokens for r in sent[:4])
    assert d("stepserve:inter_token_latency_seconds_count") > 0
    assert m1["stepserve:num_requests_running"] == m1["stepserve:num_requests_waiting"] == 0
    assert m1["stepserve:kv_cache_usage_perc"] == 0
    assert m1["stepserve:retractions_total"] >= 0
    text = httpx.get(srv.url + "/metrics", headers=srv.headers()).text
    assert "# TYPE stepserve:time_to_first_token_seconds histogram" in text
    if sys.platform.startswith("linux"):  # the front end's own process, unprefixed (read off /proc)
        assert re.search(r"^process_cpu_seconds_total \d", text, re.M)
    srv.assert_kv_clean()
