"""What clients of OpenAI, vLLM and SGLang expect of the server, through the
official `openai` client: one choice per streamed chunk with n > 1,
`stop_token_ids`, continuous usage in streams, `/version`, and a 400 naming
any field stepserve does not implement that would change the result."""

import httpx
import openai
import pytest

from server_util import server_fixtures

MODEL = "test-model"
KEY = "sk-test-key"

srv, client = server_fixtures(MODEL, KEY, kv_slots=16384, max_running=64)


def test_streamed_choices_come_one_per_chunk(client):
    """OpenAI sends each choice in its own chunk: clients read choices[0]."""
    kw = dict(model=MODEL, max_tokens=12, n=3, seed=5, temperature=1.0)
    whole = client.completions.create(prompt=["In the beginning", "And God said"], **kw)
    texts, finish = {}, {}
    for ch in client.completions.create(prompt=["In the beginning", "And God said"], stream=True, **kw):
        assert len(ch.choices) == 1
        c = ch.choices[0]
        texts[c.index] = texts.get(c.index, "") + c.text
        if c.finish_reason is not None:
            finish.setdefault(c.index, []).append(c.finish_reason)
    assert texts == {c.index: c.text for c in whole.choices} and sorted(texts) == list(range(6))
    assert finish == {c.index: [c.finish_reason] for c in whole.choices}

    msgs = [{"role": "user", "content": "Tell me of the earth."}]
    whole = client.chat.completions.create(messages=msgs, **kw)
    texts, roles, finish = {}, {}, {}
    for ch in client.chat.completions.create(messages=msgs, stream=True, **kw):
        assert len(ch.choices) == 1
        c = ch.choices[0]
        if c.delta.role:
            roles[c.index] = roles.get(c.index, 0) + 1
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if c.finish_reason is not None:
            finish.setdefault(c.index, []).append(c.finish_reason)
    assert roles == {0: 1, 1: 1, 2: 1}  # the role comes once per choice, first
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: [c.finish_reason] for c in whole.choices}


def _native_greedy(srv, ids: list[int], n: int) -> list[int]:
    r = httpx.post(srv.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={"input_ids": ids, "sampling_params": {"max_tokens": n, "temperature": 0.0,
                                                               "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["outputs"][0]["token_ids"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stop_token_ids(srv, client, route):
    """A token the model would emit stops the output there, on both routes;
    vLLM reports it as the stop reason; an id outside the vocabulary is a 400."""
    tok = srv.engine.tokenizer
    msgs = [{"role": "user", "content": "In the beginning"}]
    if route == "chat":
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tok.encode("In the beginning", add_special_tokens=False)
    free = _native_greedy(srv, ids, 16)
    stop_id = free[5]
    cut = free.index(stop_id)

    def create(**extra):
        kw = dict(model=MODEL, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True, **extra})
        if route == "chat":
            r = client.chat.completions.create(messages=msgs, **kw)
            return r.choices[0], r.choices[0].message.content, r.usage.completion_tokens
        r = client.completions.create(prompt="In the beginning", **kw)
        return r.choices[0], r.choices[0].text, r.usage.completion_tokens

    c, text, n = create()
    assert c.finish_reason == "length" and n == 16 and text == tok.decode(free)
    c, text, n = create(stop_token_ids=[stop_id])
    assert c.finish_reason == "stop" and n == cut + 1
    assert c.model_extra.get("stop_reason") == stop_id
    with pytest.raises(openai.BadRequestError) as e:
        create(stop_token_ids=[10**6])
    assert e.value.body["param"] == "stop_token_ids"


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="In the beginning", max_tokens=8, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [ch for ch in chunks if ch.choices]
    assert with_text and all(ch.usage is not None for ch in with_text)
    counts = [ch.usage.completion_tokens for ch in with_text]
    assert counts == sorted(counts) and counts[-1] == 8 and chunks[-1].usage.completion_tokens == 8
    assert all(ch.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for ch in with_text)


def test_version(srv):
    import stepserve

    r = httpx.get(srv.url + "/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": stepserve.__version__}


UNSUPPORTED = [
    ("chat", "tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("chat", "tool_choice", "required"),
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "echo", True),
    ("chat", "continue_final_message", True),
    ("completions", "prompt_logprobs", 1),
    ("completions", "truncate_prompt_tokens", 4),
    ("completions", "structured_outputs", {"regex": "[a-z]+"}),
    ("completions", "guided_json", {"type": "object"}),
    ("completions", "use_beam_search", True),
]


@pytest.mark.parametrize("route,field,value", UNSUPPORTED)
def test_unimplemented_fields_are_refused_by_name(client, route, field, value):
    """A field that would change the result and that stepserve does not
    implement is a 400 naming it, never silently dropped."""
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={field: value})
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]


def test_harmless_unknown_fields_and_nulls_are_accepted(client):
    """Fields that change nothing here (metadata, store, a null tools list,
    tool_choice none) are accepted, as OpenAI and vLLM do."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       metadata={"k": "v"}, store=False,
                                       extra_body={"tool_choice": "none", "some_future_field": 1})
    assert r.choices[0].finish_reason in ("length", "stop")
