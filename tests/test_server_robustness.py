"""Requests found, by probing a live server, to freeze it, to get a 500, or to
have a field silently dropped; each now gets a clear 400 (or is served without
stalling the engine), and the server keeps serving with its KV clean."""

import json
import threading

import httpx
import pytest

from server_util import server_fixtures
from stepserve.engine.async_engine import INLINE_TOKENIZE_CHARS

MODEL = "robust-model"
KEY = "sk-robust"

srv, client = server_fixtures(MODEL, KEY, kv_slots=8192, max_running=16)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=srv.headers(), timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def still_serving(srv, http):
    """After each test: a plain request is served, and nothing is left running or holding KV."""
    yield
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "still serving", "max_tokens": 2})
    assert r.status_code == 200, r.text
    srv.wait_idle()
    srv.assert_kv_clean()


def assert_400(resp: httpx.Response, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


@pytest.fixture
def engine_stages(srv, monkeypatch):
    """The `stages` of every request the server hands to the engine."""
    seen = []
    real = srv.engine.generate

    def generate(prompt, params, request_id, stages=None, **kw):
        seen.append(stages)
        return real(prompt, params, request_id, stages=stages, **kw)

    monkeypatch.setattr(srv.engine, "generate", generate)
    return seen


def test_fork_join_branch_texts_are_checked_and_tokenized_by_the_server(srv, http, engine_stages):
    """A branch's text suffix is length-checked and tokenized as a prompt is:
    the engine gets token ids, so it never tokenizes on its own loop (where
    7.8 MB of suffixes stalled every request in flight for 14 s)."""
    ec = srv.app.state.client
    too_long = "a" * (ec.max_model_len * ec.max_token_chars + 1)
    body = {"text": "In", "sampling_params": {"max_tokens": 2},
            "stages": [{"max_tokens": 2}, {"branches": [{"prompt": " fine", "max_tokens": 2},
                                                        {"prompt": too_long, "max_tokens": 2}]}]}
    assert_400(http.post("/generate", json=body), "stages.1.branches.1.prompt", "context_length_exceeded")
    assert engine_stages == []  # refused before anything reached the engine

    # more text than is tokenized inline, so tokenized off the event loop; each branch fits the context
    suffixes = [" one", "", [5, 6]] + [f"and {i} more, " * 30 for i in range(12)]
    assert sum(len(s) for s in suffixes if isinstance(s, str)) > INLINE_TOKENIZE_CHARS
    body = {"text": "In", "sampling_params": {"max_tokens": 2, "temperature": 0.0},
            "stages": [{"branches": [{"prompt": s, "max_tokens": 2} for s in suffixes]}, {"max_tokens": 2}]}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    k = len(suffixes)
    assert [(o["index"], o["stage"]) for o in r.json()["outputs"]] == \
        [(0, 0)] + [(1 + b, 1) for b in range(k)] + [(k + 1, 2)]
    (stages,) = engine_stages
    got = [br["prompt"] for br in stages[0]["branches"]]
    want = [ec.tokenizer.encode(s, add_special_tokens=False) if isinstance(s, str) else s for s in suffixes]
    assert got == want and all(isinstance(t, int) for ids in got for t in ids)
    assert stages[1] == {"max_tokens": 2}


@pytest.mark.parametrize("body,param", [
    ({"text": "In", "sampling_params": {"max_new_token": 5}}, "sampling_params.max_new_token"),  # a typo
    ({"text": "In", "return_logprobs": True}, "return_logprobs"),
    # SGLang's, not implemented here
    ({"text": "In", "sampling_params": {"structural_tag": "x"}}, "sampling_params.structural_tag"),
    ({"text": "In", "stages": [{"max_tokens": 2, "n": 2}]}, "stages.0.n"),
    ({"text": "In", "stages": [{"branches": [{"prompt": "a", "max_tokens": 2, "stages": []}]}]},
     "stages.0.branches.0.stages"),
])
def test_native_route_refuses_unknown_fields(http, body, param):
    """/generate takes the engine's own names (and SGLang's that it
    implements): an unknown one is a 400 naming it, not silently dropped (a
    request with SGLang's `max_new_tokens` once got 16 tokens)."""
    err = assert_400(http.post("/generate", json=body), param)
    assert "not permitted" in err["message"]


def test_native_json_schema_error_names_its_field(http):
    body = {"text": "In", "sampling_params": {"max_tokens": 2, "json_schema": {"type": "no-such-type"}}}
    assert_400(http.post("/generate", json=body), "sampling_params.json_schema")


SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}  # a schema no JSON value meets


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "In", "max_tokens": 4,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF_REF}}},
     "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "In", "max_tokens": 4, "structured_outputs": {"regex": "[^\\s\\S]"}},
     "structured_outputs"),
    ("/generate", {"text": "In", "sampling_params": {"max_tokens": 4, "json_schema": SELF_REF}},
     "sampling_params.json_schema"),
])
def test_a_constraint_no_output_can_meet_is_a_400(http, path, body, param):
    """A constraint that matches no output (a schema that only refers to
    itself, a regex no string matches) is refused, rather than answered with
    an empty text that breaks it (finish_reason "stop", as if it were met)."""
    err = assert_400(http.post(path, json=body))
    assert err["param"].startswith(param) and "matches no output" in err["message"], err


DEEP = "[" * 3000 + "]" * 3000  # valid JSON, within the test model's text limit, past the parser's depth


def test_deeply_nested_json_texts_get_400_not_500(srv, http):
    ec = srv.app.state.client
    assert len(DEEP) < ec.max_model_len * ec.max_token_chars  # reaches the parsing, not the length check
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert_400(http.post("/v1/chat/completions", json={**chat, "guided_json": DEEP}), "guided_json")
    assert_400(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                  "structured_outputs": {"json": DEEP}}), "structured_outputs")
    # an assistant's call arguments too deep to parse are passed on as text, as non-JSON ones are
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = http.post("/v1/chat/completions", json={**chat, "messages": msgs})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:  # the rendered conversation may be too long for the test model's context
        assert_400(r, "messages", "context_length_exceeded")
    items = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
             {"type": "function_call_output", "call_id": "c1", "output": "ok"}]
    r = http.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert_400(r, "messages", "context_length_exceeded")


@pytest.mark.parametrize("extra,param", [
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),  # no schema
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": [1]}]}, "tools.0.parameters"),
    ({"seed": 2**70}, "seed"),
])
def test_responses_errors_name_the_field(http, extra, param):
    """Not "Invalid request: 1 validation error for ChatCompletionRequest" with param "input"."""
    err = assert_400(http.post("/v1/responses", json={"model": MODEL, "input": "hi", **extra}), param)
    assert "ChatCompletionRequest" not in err["message"]


def test_responses_previous_response_must_hold_a_conversation(srv, http):
    """Continuing from a background response that is still queued (or was
    cancelled) is a 400: its conversation is not stored yet, and the request
    was answered as if it had no previous_response_id."""
    srv.engine.pause()  # hold the engine: the background response stays queued
    try:
        bg = http.post("/v1/responses", json={"model": MODEL, "input": "In the beginning", "background": True,
                                              "max_output_tokens": 8}).json()
        assert bg["status"] == "queued"
        follow = {"model": MODEL, "input": "and then?", "previous_response_id": bg["id"], "max_output_tokens": 2}
        err = assert_400(http.post("/v1/responses", json=follow), "previous_response_id")
        assert "in progress" in err["message"]
        assert http.post(f"/v1/responses/{bg['id']}/cancel").json()["status"] == "cancelled"
        err = assert_400(http.post("/v1/responses", json=follow), "previous_response_id")
        assert "cancelled" in err["message"]
    finally:
        srv.engine.resume()
    done = http.post("/v1/responses", json={"model": MODEL, "input": "In the beginning", "max_output_tokens": 2})
    fresh = http.post("/v1/responses", json={"model": MODEL, "input": "and then?", "max_output_tokens": 2})
    follow = http.post("/v1/responses", json={"model": MODEL, "input": "and then?", "max_output_tokens": 2,
                                              "previous_response_id": done.json()["id"]})
    assert follow.status_code == 200, follow.text
    assert follow.json()["usage"]["input_tokens"] > fresh.json()["usage"]["input_tokens"]  # the history is in


def test_a_body_not_sent_as_json_says_so(http):
    """`curl -d` sends a form's Content-Type; the body is not read as JSON."""
    raw = json.dumps({"model": MODEL, "prompt": "In", "max_tokens": 2}).encode()
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        err = assert_400(http.post("/v1/completions", content=raw, headers={"content-type": ctype}))
        assert "Content-Type: application/json" in err["message"] and ctype in err["message"]
    assert http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}).status_code == 200


def test_conversations_of_many_messages_are_rendered_off_the_event_loop(srv, http, monkeypatch):
    """200,000 empty messages took a second of template rendering on the event
    loop (every request and /health waited); with tools, the check that the
    template renders them rendered a second time, inline, whatever the size."""
    tok = srv.app.state.client.tokenizer
    threads = []
    real = tok.apply_chat_template

    def render(*a, **kw):
        threads.append(threading.current_thread())
        return real(*a, **kw)

    monkeypatch.setattr(tok, "apply_chat_template", render)
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(101)]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        threads.clear()
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": many, "max_tokens": 2, **extra})
        assert r.status_code in (200, 400), r.text
        assert threads and all(t is not srv.thread for t in threads), threads
