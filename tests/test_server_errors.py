"""Every bad request gets a 4xx with OpenAI's error body, one case at a time,
and the server keeps serving; `--api-key` auth; 429 when the admission queue
is full, with nothing accepted lost."""

import asyncio
import json

import httpx
import openai
import pytest

from server_util import served, server_fixtures

MODEL = "err-model"
KEY = "sk-errors"


MAX_BODY = 256 << 10
srv, client = server_fixtures(MODEL, KEY, kv_slots=8192, max_running=16, max_request_bytes=MAX_BODY)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=60) as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param=None, code=None):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def ok_completion(**kw):
    return {"model": MODEL, "prompt": "In the beginning", "max_tokens": 4, **kw}


def ok_chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


LONG = [5] * 600  # the checkpoint's context is 512

# (route, body, expected param) -- each must give 400
BAD_REQUESTS = [
    ("/v1/completions", ok_completion(temperature="hot"), "temperature"),
    ("/v1/completions", ok_completion(n="2"), "n"),
    ("/v1/completions", ok_completion(max_tokens=1.5), "max_tokens"),
    ("/v1/completions", ok_completion(prompt=5), "prompt"),
    ("/v1/completions", ok_completion(prompt=None), "prompt"),
    ("/v1/completions", ok_completion(stream="yes"), "stream"),
    ("/v1/completions", ok_completion(prompt=LONG), "prompt"),
    ("/v1/completions", ok_completion(prompt=[LONG[:10], LONG]), "prompt"),
    ("/v1/completions", ok_completion(max_tokens=600), "max_tokens"),
    ("/v1/completions", ok_completion(max_tokens=10**12), "max_tokens"),
    ("/v1/completions", ok_completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", ok_completion(max_tokens=-5), "max_tokens"),
    ("/v1/completions", ok_completion(n=17), "n"),
    ("/v1/completions", ok_completion(n=0), "n"),
    ("/v1/completions", ok_completion(logprobs=6), "logprobs"),
    ("/v1/completions", ok_completion(logprobs=-1), "logprobs"),
    ("/v1/completions", ok_completion(prompt=""), "prompt"),
    ("/v1/completions", ok_completion(prompt=[]), "prompt"),
    ("/v1/completions", ok_completion(prompt=[[]]), "prompt"),
    ("/v1/completions", ok_completion(prompt=[1, -2]), "prompt"),
    ("/v1/completions", ok_completion(prompt=[1, 10**6]), "prompt"),
    ("/v1/completions", ok_completion(prompt="bad \ud800 text"), "prompt"),
    ("/v1/completions", ok_completion(stop=""), "stop"),
    ("/v1/completions", ok_completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    ("/v1/completions", ok_completion(stop=[1]), "stop"),
    ("/v1/completions", ok_completion(stop=["ok", ""]), "stop"),
    ("/v1/completions", ok_completion(temperature=-1), "temperature"),
    ("/v1/completions", ok_completion(temperature=1e308), "temperature"),
    ("/v1/completions", ok_completion(top_p=2), "top_p"),
    ("/v1/completions", ok_completion(top_k=-5), "top_k"),
    ("/v1/completions", ok_completion(min_p=1.5), "min_p"),
    ("/v1/completions", ok_completion(seed=2**70), "seed"),
    ("/v1/completions", ok_completion(presence_penalty=5), "presence_penalty"),
    ("/v1/completions", ok_completion(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", ok_completion(repetition_penalty=0), "repetition_penalty"),
    ("/v1/completions", ok_completion(logit_bias={"abc": 1}), "logit_bias"),
    ("/v1/completions", ok_completion(logit_bias={"999999": 1}), "logit_bias"),
    ("/v1/completions", ok_completion(logit_bias={"5": 1000}), "logit_bias"),
    ("/v1/completions", ok_completion(best_of=3), "best_of"),
    ("/v1/completions", ok_completion(suffix="tail"), "suffix"),
    ("/v1/completions", ok_completion(stream_options={"include_usage": True}), "stream_options"),
    ("/v1/completions", ok_completion(response_format={"type": "xml"}), "response_format.type"),
    ("/v1/chat/completions", ok_chat(messages=[]), "messages"),
    ("/v1/chat/completions", ok_chat(messages="hi"), "messages"),
    ("/v1/chat/completions", ok_chat(messages=[{"role": "", "content": "x"}]), "messages.0.role"),
    ("/v1/chat/completions", ok_chat(messages=[{"content": "x"}]), "messages.0.role"),
    ("/v1/chat/completions", ok_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None),
    ("/v1/chat/completions", ok_chat(messages=[{"role": "user", "content": "x" * 3000}]), "messages"),
    ("/v1/chat/completions", ok_chat(max_completion_tokens=10**9), "max_completion_tokens"),
    ("/v1/chat/completions", ok_chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    ("/v1/chat/completions", ok_chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", ok_chat(logprobs=3), "logprobs"),
    ("/v1/chat/completions", ok_chat(response_format={"type": "json_schema"}), "response_format"),
    ("/v1/chat/completions", ok_chat(response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    # a lone surrogate anywhere in a JSON object that reaches the tokenizer or the grammar compiler (keys too)
    ("/v1/chat/completions", ok_chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"description": "\ud800"}}}]), "tools.0.function.parameters"),
    ("/v1/chat/completions", ok_chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {"\ud800": {"type": "string"}}}}}]), "tools.0.function.parameters"),
    ("/v1/chat/completions", ok_chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "description": "\udc00"}}}), "response_format.json_schema.schema"),
    ("/v1/chat/completions", ok_chat(chat_template_kwargs={"x": ["\ud800"]}), "chat_template_kwargs"),
    ("/v1/completions", ok_completion(guided_json={"type": "string", "enum": ["\ud800"]}), "guided_json"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3,
                       "tools": [{"type": "function", "name": "f", "parameters": {"description": "\ud800"}}]},
     "tools.0"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3, "metadata": {"k": "\ud800"}}, "metadata"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2000}, "max_output_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": {"description": "\ud800"}}},
     "sampling_params.json_schema"),
    ("/generate", {"sampling_params": {"max_tokens": 2}}, None),
    ("/generate", {"text": "a", "input_ids": [1], "sampling_params": {}}, None),
    ("/generate", {"input_ids": [1, 100000]}, "input_ids"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": "x"}}, "sampling_params.temperature"),
    ("/generate", {"text": "a", "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"stop_token_ids": [10**6]}}, "sampling_params.stop_token_ids"),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(srv, http, client):
    failures = []
    for route, body, param in BAD_REQUESTS:
        resp = http.post(route, content=json.dumps(body, ensure_ascii=True), headers={"content-type": "application/json"})
        try:
            assert_error(resp, 400, param)
        except AssertionError as e:
            failures.append((route, body if len(json.dumps(body)) < 200 else "<long>", str(e)[:300]))
    assert not failures, failures
    r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    srv.wait_idle()
    srv.assert_kv_clean()


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", '{"prompt": "x", "max_tokens": 2, "temperature": NaN}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": -Infinity}}', "logit_bias"),
    ("/v1/responses", '{"input": "x", "temperature": NaN}', "temperature"),
    ("/generate", '{"text": "x", "sampling_params": {"min_p": NaN}}', "sampling_params.min_p"),
])
def test_nan_and_infinity_are_not_numbers_here(http, route, body, param):
    """Python's JSON reads NaN and Infinity; every float field refuses them as
    what they are (not "should be less than or equal to 2")."""
    err = assert_error(http.post(route, content=body, headers={"content-type": "application/json"}), 400, param)
    assert "finite" in err["message"], err


def test_malformed_bodies(http):
    for raw in (b"{", b"not json", b'{"model": "x",}', b"[1, 2]", b'"just a string"', b"", b"\xff\xfe\xfd",
                b'{"prompt": "\xff\xfe"}'):
        for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
            resp = http.post(route, content=raw, headers={"content-type": "application/json"})
            assert_error(resp, 400)


def test_errors_through_the_openai_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=99)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True, stop=[""])
    assert e.value.body["param"] == "stop"


def test_oversized_bodies_get_413_and_the_server_keeps_serving(http, client):
    big = json.dumps({"model": MODEL, "prompt": "x" * (MAX_BODY + 10), "max_tokens": 2}).encode()
    assert_error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    resp = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(resp, 413)
    assert resp.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt=[7] * (MAX_BODY // 2), max_tokens=2)
    assert e.value.status_code == 413
    r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_auth(srv):
    routes = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/openapi.json"),
              ("GET", "/v1/nothing")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        for method, path in routes:
            resp = httpx.request(method, srv.url + path, headers=headers, json=ok_completion(), timeout=30)
            assert_error(resp, 401, code="invalid_api_key")
    for path in ("/health", "/version", "/metrics"):  # open, as in vLLM: probes and scrapers send no key
        assert httpx.get(srv.url + path).status_code == 200
    # the scheme's case is free (RFC 7235), the key's is not
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert_error(httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY.upper()}"}), 401,
                 code="invalid_api_key")
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()


def test_429_when_the_queue_is_full_and_nothing_accepted_is_lost(srv, client):
    adm = srv.app.state.client.admission
    old_limit = adm.limit
    adm.limit = 4  # as if started with --max-running 2 --max-queued-requests 2
    rejected0 = srv.metrics()["stepserve:requests_rejected_total"]
    srv.engine.pause()  # hold the engine so accepted requests stay in flight

    async def go():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            accepted = [asyncio.ensure_future(c.completions.create(
                model=MODEL, prompt=f"queued {i}", max_tokens=8, extra_body={"ignore_eos": True}))
                for i in range(4)]
            while adm.in_flight < 4:
                await asyncio.sleep(0.01)
            refused = []
            for i in range(3):
                with pytest.raises(openai.RateLimitError) as e:
                    await c.completions.create(model=MODEL, prompt="one too many", max_tokens=8)
                refused.append(e.value)
            srv.engine.resume()
            return await asyncio.gather(*accepted), refused

    try:
        done, refused = asyncio.run(go())
    finally:
        srv.engine.resume()
        adm.limit = old_limit
    for e in refused:
        assert e.status_code == 429 and e.response.headers["retry-after"] == "1"
        assert e.body["code"] == "rate_limit_exceeded"
    assert [r.choices[0].finish_reason for r in done] == ["length"] * 4
    assert all(r.usage.completion_tokens == 8 for r in done)
    srv.wait_idle()
    assert srv.metrics()["stepserve:requests_rejected_total"] - rejected0 == 3
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=2).choices


def test_a_request_that_could_never_be_admitted_is_a_400_not_a_429(srv, client):
    """More engine requests at once than the server ever admits (prompts of
    one request; beam search's width per prompt): a 400 naming the field,
    on an idle server, where a 429 would have the client retry in vain."""
    adm = srv.app.state.client.admission
    old_limit = adm.limit
    adm.limit = 3  # as if started with --max-running 1 --max-queued-requests 2
    try:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=["a", "b", "c", "d"], max_tokens=2)
        assert e.value.body["param"] == "prompt" and "at most 3" in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="a", max_tokens=2, n=4, extra_body={"use_beam_search": True})
        assert e.value.body["param"] == "n"
        # as many as fit: served
        assert len(client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=2).choices) == 3
        assert len(client.completions.create(model=MODEL, prompt="a", max_tokens=2, n=3,
                                             extra_body={"use_beam_search": True}).choices) == 3
    finally:
        adm.limit = old_limit


def test_too_long_texts_are_refused_before_tokenizing(srv, http, monkeypatch):
    """A text longer than max_model_len tokens of the longest token could
    hold gets 400 context_length_exceeded without being tokenized (or, for
    chat, rendered): on every text route, and in a batch of prompts even
    when only the last one is too long."""
    ec = srv.app.state.client
    limit = ec.max_model_len * ec.max_token_chars
    seen = []
    real = ec.tokenizer.encode

    def encode(text, *a, **kw):
        seen.append(len(text))
        return real(text, *a, **kw)

    monkeypatch.setattr(ec.tokenizer, "encode", encode)
    long = "a" * (limit + 1)
    cases = [("/v1/completions", {"model": MODEL, "prompt": long}, "prompt"),
             ("/v1/completions", {"model": MODEL, "prompt": ["fine", long]}, "prompt"),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": long}]}, "messages"),
             ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": long[:limit // 2]},
                                                                    {"role": "user", "content": long[:limit // 2 + 2]}]},
              "messages"),
             ("/generate", {"model": MODEL, "text": long}, "text")]
    for route, body, param in cases:
        err = assert_error(http.post(route, json=body), 400, param, "context_length_exceeded")
        assert "characters" in err["message"]
    assert seen == []
    # just inside the bound: tokenized (off the event loop), then refused by its token count
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "ab " * (limit // 3)})
    assert_error(r, 400, "prompt", "context_length_exceeded")
    assert seen == [limit // 3 * 3]
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_the_length_bound_never_refuses_a_text_that_fits(srv):
    """The bound is sound: every text has at most (its tokens) x
    max_token_chars characters, for the tokenizer served here."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    ec = srv.app.state.client
    pieces = [ec.tokenizer.decode([i]) for i in range(len(ec.tokenizer))]

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from(pieces), max_size=40) | st.text(max_size=400))
    def check(parts):
        text = parts if isinstance(parts, str) else "".join(parts)
        ids = ec.tokenizer.encode(text, add_special_tokens=False)
        assert len(text) <= max(len(ids), 1) * ec.max_token_chars

    check()


def test_requests_whose_branches_need_more_rows_than_are_free_wait_for_them(srv, http, client):
    """Three prompts with n = 16 on a server that keeps 40 rows (max_running
    16): their parents are admitted together, and forking all of them at once
    would take 48 rows. They queue for rows instead, and every choice comes
    back, the server still serving and its KV clean."""
    r = client.completions.create(model=MODEL, prompt=["a b", "c d", "e f"], n=16, max_tokens=2, seed=3)
    assert sorted(c.index for c in r.choices) == list(range(48))
    r = client.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")
    srv.wait_idle()
    srv.assert_kv_clean()


def test_an_n_larger_than_the_rows_kept_is_refused_not_queued_forever(llama_ckpt):
    """max_running 2 keeps 12 rows: n = 16 could never run, and it would block
    every request queued behind it. It gets a 400 naming n at once."""
    with served(llama_ckpt, served_model_name=MODEL, max_running=2) as s:
        with httpx.Client(base_url=s.url, timeout=30) as h:
            for route, body in (("/v1/completions", ok_completion(n=16)), ("/v1/chat/completions", ok_chat(n=16))):
                err = assert_error(h.post(route, json=body), 400, "n")
                assert "12" in err["message"], err
            assert h.post("/v1/completions", json=ok_completion(n=12, max_tokens=2)).status_code == 200
        s.wait_idle()
        s.assert_kv_clean()
