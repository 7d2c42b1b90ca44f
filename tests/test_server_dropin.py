"""What clients of OpenAI, vLLM and SGLang expect of the server, through the
official `openai` client: one choice per streamed chunk with n > 1,
`stop_token_ids`, continuous usage in streams, `/version`, and a 400 naming
any field stepserve does not implement that would change the result."""

import json
import re

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


def test_continuous_usage_stats_only_with_include_usage(client):
    """As in vLLM, continuous_usage_stats adds to include_usage: alone it adds nothing."""
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))
    assert all(ch.usage is None for ch in chunks)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(ch.usage is not None for ch in chunks)  # the role chunk too
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].usage.completion_tokens == 4


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


def test_server_info_as_sglang_names_it(srv, llama_ckpt):
    """SGLang's `GET /get_server_info` (and `/server_info`): the engine's
    sizing and schedule under SGLang's names, equal to what the engine and
    /metrics report; behind the API key like every route but the probes'."""
    import stepserve

    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(srv.url + "/get_server_info", timeout=10).status_code == 401
    got = httpx.get(srv.url + "/get_server_info", headers=auth, timeout=10).json()
    assert httpx.get(srv.url + "/server_info", headers=auth, timeout=10).json() == got
    models = httpx.get(srv.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]
    blocks = re.search(r'cache_config_info\{block_size="1",num_gpu_blocks="(\d+)"\}',
                       httpx.get(srv.url + "/metrics", timeout=10).text)
    assert got["max_total_num_tokens"] == 16384 == int(blocks.group(1))  # the fixture's kv_slots
    assert got["max_running_requests"] == 64 and got["page_size"] == 1
    assert got["context_length"] == models["max_model_len"] and got["vocab_size"] == models["vocab_size"]
    assert got["served_model_name"] == MODEL and got["model_path"] == models["root"] == llama_ckpt
    assert got["chunked_prefill_size"] == got["max_batched_tokens"] == 2048  # the engine's default step budget
    # the overlap schedule where the engine runs on CUDA (without speculation), the plain one on a CPU
    on_cuda = got["device"].startswith("cuda")
    assert got["overlap_schedule"] is on_cuda and got["disable_overlap_schedule"] is not on_cuda
    assert got["speculative_algorithm"] is None and got["speculative"] == "none"
    assert got["attention_backend"] and got["version"] == stepserve.__version__
    # which prompt chunks run as decode-shaped queries (`FoldRule`), as an engine of this checkpoint decides
    from stepserve import LLM

    rule = LLM(llama_ckpt, device="cpu" if got["device"] == "cpu" else "auto", kv_slots=1024).engine.runner.fold_rule
    assert (got["fold_tokens"], got["fold_pairs"]) == (rule.tokens, rule.pairs)


UNSUPPORTED = [
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", "auto"),
    ("chat", "bad_words", ["x"]),
    ("completions", "return_tokens_as_token_ids", True),
    ("chat", "use_beam_search", True),
    ("completions", "bad_words", ["x"]),
    # the other route's (or SGLang's native) names: a client that sends them means them
    ("completions", "max_completion_tokens", 3),
    ("completions", "max_new_tokens", 3),
    ("completions", "top_logprobs", 3),
    ("completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("completions", "typical_p", 0.5),
    ("chat", "max_new_tokens", 3),
    ("chat", "best_of", 3),
    ("chat", "suffix", "x"),
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


# -- tool calling (the embedded model, whose chat template renders tools) -------------------------------------
@pytest.fixture(scope="module")
def tsrv():
    from server_util import ServerThread
    from stepserve.engine.defaults import DEFAULT_MODEL

    with ServerThread(DEFAULT_MODEL, served_model_name=MODEL, api_key=KEY, max_running=32) as s:
        yield s


@pytest.fixture(scope="module")
def tclient(tsrv):
    with openai.OpenAI(base_url=tsrv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(call, tools):
    """The call names one of `tools` and its arguments are valid for its
    parameters (these tests' schemas: required enum properties, nothing else)."""
    import json

    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in spec
    args, schema = json.loads(call.function.arguments), spec[call.function.name]
    assert isinstance(args, dict) and set(args) == set(schema["required"]) == set(schema["properties"])
    assert all(v in schema["properties"][k]["enum"] for k, v in args.items()), args


def test_named_tool_choice_forces_a_valid_call(tclient):
    client = tclient
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=64, temperature=1.0, seed=3,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "get_weather"
    _check_call(c.message.tool_calls[0], [WEATHER, TIME])
    # streamed: the id, type and name first, then the arguments in pieces, as OpenAI streams them
    ids, names, args, finish = set(), [], "", []
    for ch in client.chat.completions.create(stream=True, **kw):
        d = ch.choices[0].delta
        for tc in d.tool_calls or ():
            assert tc.index == 0
            if tc.id:
                ids.add(tc.id)
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    assert len(ids) == 1 and names == ["get_weather"] and finish == ["tool_calls"]
    assert args == c.message.tool_calls[0].function.arguments  # same seed, same call


def test_named_tool_call_cut_by_max_tokens_is_still_the_call(tclient):
    """max_tokens that cut the arguments short: the call comes back with the
    arguments generated so far and finish_reason "length", streamed or not."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=3, temperature=1.0, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = tclient.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{") and not call.function.arguments.endswith("}")
    args, finish = "", []
    for ch in tclient.chat.completions.create(stream=True, **kw):
        assert not ch.choices[0].delta.content
        for tc in ch.choices[0].delta.tool_calls or ():
            args += tc.function.arguments or ""
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    assert finish == ["length"] and args == call.function.arguments


def test_named_tool_call_with_no_output_is_the_same_call_streamed_or_not(tclient):
    """A stop string that matches before any argument text (the grammar's
    first character): the call with empty arguments either way."""
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0.0, stop=["{"],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = tclient.chat.completions.create(**kw).choices[0]
    assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.arguments == ""
    calls, finish = [], []
    for ch in tclient.chat.completions.create(stream=True, **kw):
        assert not ch.choices[0].delta.content
        calls += ch.choices[0].delta.tool_calls or []
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [("get_weather", "")]
    assert calls[0].id.startswith("call_") and finish == [c.finish_reason]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_gives_calls_of_the_given_tools(tclient, parallel):
    """The output is a JSON array of calls (one at most without parallel
    calls). A KJV model left alone keeps adding calls, so a bias on "]" lets
    the arrays close (it can only be sampled where the grammar allows it)."""
    from transformers import AutoTokenizer

    from stepserve.engine.defaults import DEFAULT_MODEL

    close = AutoTokenizer.from_pretrained(DEFAULT_MODEL).convert_tokens_to_ids("]")
    client = tclient
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=parallel, max_tokens=120, temperature=1.0, seed=seed,
                                           logit_bias={str(close): 30})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        if not parallel:
            assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            _check_call(call, [WEATHER, TIME])
        assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)
    # streamed: each call as one delta with its index, then the finish
    calls, finish = {}, []
    for ch in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=parallel, max_tokens=120, temperature=1.0, seed=2,
                                             logit_bias={str(close): 30}, stream=True):
        for tc in ch.choices[0].delta.tool_calls or ():
            calls[tc.index] = (tc.function.name, tc.function.arguments)
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    assert finish == ["tool_calls"]
    assert [calls[i] for i in range(len(calls))] == [(t.function.name, t.function.arguments)
                                                     for t in c.message.tool_calls]  # seed 2 again


def test_auto_renders_the_tools_and_returns_text_when_no_call_is_made(tclient):
    client = tclient
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0.0)
    auto = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0.0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tool list is in the prompt
    c = auto.choices[0]
    assert c.message.tool_calls is None and c.finish_reason in ("stop", "length") and c.message.content
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none",
                                          max_tokens=8, temperature=0.0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # "none": the tools are not rendered


def test_tool_results_go_back_through_the_template(tclient):
    client = tclient
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny and warm."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=4)
    shorter = client.chat.completions.create(model=MODEL, messages=msgs[:2], tools=[WEATHER], max_tokens=4)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens + 10


@pytest.mark.parametrize("kw,param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "bad", "parameters": {"type": "frobnicate"}}}],
          tool_choice="required"), "tools"),
])
def test_bad_tool_requests_are_400s(tclient, kw, param):
    client = tclient
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)
    assert e.value.body["param"] == param


def test_a_template_without_tools_refuses_them(client):
    """The test checkpoint's template ignores `tools`: the model would answer
    blind, so the request is refused rather than served without them."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=4)
    assert e.value.body["param"] == "tools"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None


def test_tool_call_parser_in_pieces():
    """The auto-mode parser gives the same content and calls however the text
    is split into stream deltas, holds back a possible tag start, and passes a
    block that is not a call through as content."""
    from stepserve.server.tools import ToolCallParser

    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n'
            '</tool_call><tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call> '
            'and <tool_call>not json</tool_call> done <tool_')
    want_content = "Let me look.  and <tool_call>not json</tool_call> done <tool_"
    for step in (1, 2, 3, 7, len(text)):
        p = ToolCallParser()
        content, calls = "", []
        for i in range(0, len(text), step):
            c, new = p.feed(text[i : i + step])
            content += c
            calls += new
        content += p.finish()
        assert content == want_content
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Rome", "days": 2}'),
                                                          ("get_time", '{"zone": "UTC"}')]


# -- vLLM's extension fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("field,value,check", [
    ("structured_outputs", {"regex": "(amen|selah) [0-9]{2}"}, lambda t: re.fullmatch("(amen|selah) [0-9]{2}", t)),
    ("structured_outputs", {"choice": ["In the beginning", "And God said"]},
     lambda t: t in ("In the beginning", "And God said")),
    ("structured_outputs", {"grammar": 'start: "yea" " " ("verily" | "nay")'}, lambda t: t in ("yea verily", "yea nay")),
    ("structured_outputs", {"json": {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
                                     "additionalProperties": False}}, lambda t: json.loads(t)["n"] in (1, 2)),
    ("guided_regex", "[a-c]{3}", lambda t: re.fullmatch("[a-c]{3}", t)),
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("guided_json", '{"type": "object", "properties": {"k": {"enum": ["v"]}}, "required": ["k"], '
                    '"additionalProperties": false}',
     lambda t: json.loads(t) == {"k": "v"}),
])
def test_structured_outputs(client, route, field, value, check):
    for seed in range(3):
        kw = dict(model=MODEL, max_tokens=40, temperature=1.0, seed=seed, extra_body={field: value})
        if route == "chat":
            c = client.chat.completions.create(messages=[{"role": "user", "content": "Speak"}], **kw).choices[0]
            text = c.message.content
        else:
            c = client.completions.create(prompt="Speak", **kw).choices[0]
            text = c.text
        assert c.finish_reason == "stop" and check(text), (field, text)


@pytest.mark.parametrize("body,param", [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),  # {} is a schema: two constraints
])
def test_bad_structured_outputs_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("body", [
    {"guided_json": {}}, {"structured_outputs": {"json": {}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "any", "schema": {}}}},
])
def test_the_empty_schema_constrains_to_any_json(client, body):
    """The empty JSON schema {} means any JSON value: a constraint like any
    other (it was taken for no constraint, and one form for a bad request)."""
    for seed in range(3):
        c = client.completions.create(model=MODEL, prompt="Speak", max_tokens=60, temperature=1.0, seed=seed,
                                      extra_body=body).choices[0]
        if c.finish_reason == "stop":
            json.loads(c.text)
        else:  # cut by max_tokens: a JSON value so far, as the constraint allowed it
            assert c.text.strip()[:1] in set('{["-0123456789tfn'), c.text


@pytest.mark.parametrize("field,value", [
    ("guided_regex", "a{1000000}"),  # compiles, then outgrows llguidance's lexer after the first token
    ("guided_grammar", 'start: "a" start'),  # no finite string matches: the parser outgrows its limit
])
def test_a_constraint_that_gives_up_mid_output_is_an_error_not_a_stop(srv, client, field, value):
    """llguidance may give up on a constraint after a few tokens (its size
    limits), leaving only the end token: that output does not match the
    constraint, so it must not come back as a finished answer. Unary and
    streamed, the client gets a 400 that says why, and the server serves on."""
    kw = dict(model=MODEL, prompt="x", max_tokens=40, extra_body={field: value})
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    assert e.value.body["code"] == "constraint_too_complex", e.value.body
    with pytest.raises(openai.APIError, match="could not be followed"):
        for _ in client.completions.create(stream=True, **kw):
            pass
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=12, extra_body={"guided_regex": "a{8}"})
    assert r.choices[0].text == "a" * 8 and r.choices[0].finish_reason == "stop"
    srv.wait_idle()
    srv.assert_kv_clean()


def test_a_constraint_outranks_the_masks_before_it(srv, client):
    """min_tokens masks the stop tokens (EOS, stop_token_ids) until it is met.
    Where a constraint allows nothing else -- a choice already complete, JSON
    whose opening brace is a stop token id -- its own tokens stay: never a
    token it refuses (choosing among nothing drew token 0, which the grammar
    then failed as 'too complex')."""
    (brace,) = srv.engine.tokenizer.encode("{", add_special_tokens=False)
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="x", max_tokens=24, temperature=0.0)
        got = client.completions.create(stream=stream, **kw, extra_body={
            "response_format": {"type": "json_object"}, "stop_token_ids": [brace], "min_tokens": 3})
        text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
        assert text.startswith("{"), text
        got = client.completions.create(stream=stream, **kw, extra_body={"guided_choice": ["yea"], "min_tokens": 6})
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == "yea"
        assert chunks[-1].choices[0].finish_reason == "stop"
    srv.wait_idle()
    srv.assert_kv_clean()


def test_truncate_prompt_tokens(client):
    long = "In the beginning God created the heaven and the earth. " * 4
    full = client.completions.create(model=MODEL, prompt=long, max_tokens=1)
    cut = client.completions.create(model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": 7})
    assert full.usage.prompt_tokens > 7 and cut.usage.prompt_tokens == 7
    msgs = [{"role": "user", "content": long}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body={"truncate_prompt_tokens": 9})
    assert r.usage.prompt_tokens == 9


def test_continue_final_message_and_echo(srv, client):
    """The last assistant message is continued (the template leaves it open),
    as the same rendered text on /v1/completions continues it; echo puts it
    in front of the answer."""
    tok = srv.engine.tokenizer
    msgs = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "In the beginning"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("In the beginning")
    want = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    kw = dict(model=MODEL, messages=msgs, max_tokens=8, temperature=0.0)
    body = {"ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True}
    got = client.chat.completions.create(**kw, extra_body=body).choices[0].message.content
    assert got == want
    echoed = client.chat.completions.create(**kw, extra_body={**body, "echo": True}).choices[0].message.content
    assert echoed == "In the beginning" + want
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        **kw, extra_body={**body, "echo": True}, stream=True) if ch.choices)
    assert streamed == echoed
    # continue_final_message alone (as SGLang's clients send it) implies no generation prompt
    alone = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "continue_final_message": True})
    assert alone.choices[0].message.content == want
    with pytest.raises(openai.BadRequestError) as e:  # both asked for explicitly: they conflict
        client.chat.completions.create(**kw, extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message"


# -- the Responses API (the embedded model) ------------------------------------------------------------
def test_responses_create_and_stream(tclient):
    client = tclient
    kw = dict(model=MODEL, input="Tell me of the earth.", instructions="Answer in the words of Genesis.",
              max_output_tokens=300, temperature=0.0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text
    assert r.status == "completed" and r.output[0].type == "message"  # the model ended its turn
    assert r.usage.input_tokens > 10 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # beside OpenAI's names, the chat names SGLang's clients read
    assert (r.usage.model_extra["prompt_tokens"], r.usage.model_extra["completion_tokens"]) == (
        r.usage.input_tokens, r.usage.output_tokens)
    cut = client.responses.create(**{**kw, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3
    # the same request through the streaming helper: typed events, the same text
    types, deltas = [], []
    with client.responses.stream(**kw) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert "".join(deltas) == final.output_text == r.output_text


def test_responses_store_previous_response_and_retrieve(tclient):
    client = tclient
    first = client.responses.create(model=MODEL, input="In the beginning", max_output_tokens=6, temperature=0.0)
    again = client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == first.output_text
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0.0)
    alone = client.responses.create(model=MODEL, input="And then?", max_output_tokens=6, temperature=0.0,
                                    store=False)
    # the earlier turn and its answer are in the second prompt
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=False
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and "not found." in e.value.body["message"]


def test_responses_json_schema_and_function_calls(tclient):
    client = tclient
    schema = {"type": "object", "properties": {"answer": {"enum": ["yea", "nay"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Say yea or nay", max_output_tokens=40, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    assert json.loads(r.output_text)["answer"] in ("yea", "nay")
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=[tool], max_output_tokens=64,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)
    # the function's output goes back as an input item, continuing the stored conversation
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, tools=[tool], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "Sunny"}], max_output_tokens=5)
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    # streamed: the call arrives as an output item with its arguments
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[tool], max_output_tokens=64,
                                 tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0) as s:
        done = [e.item for e in s if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["function_call"] and json.loads(done[0].arguments)["days"] in (1, 2, 3)


def test_responses_in_the_background(tsrv, tclient):
    """background: answered at once ("queued"), "in_progress" once admitted,
    finished in the store, polled with GET; cancel stops one still running
    (the engine is held meanwhile), and leaves a finished or synchronous one
    alone; delete stops one still running, which then stays gone."""
    import time

    client = tclient
    r = client.responses.create(model=MODEL, input="In the beginning", max_output_tokens=8, background=True)
    assert r.status == "queued"
    for _ in range(200):
        r = client.responses.retrieve(r.id)
        if r.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert r.status in ("completed", "incomplete") and r.output_text
    tsrv.engine.pause()
    try:
        held = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=500,
                                       background=True)
        assert client.responses.retrieve(held.id).status == "queued"
        cancelled = client.responses.cancel(held.id)
        assert cancelled.status == "cancelled"
    finally:
        tsrv.engine.resume()
    for _ in range(100):  # the cancelled request was aborted in the engine, not left running
        if tsrv.metrics()["stepserve:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert tsrv.metrics()["stepserve:num_requests_running"] == 0
    assert client.responses.retrieve(held.id).status == "cancelled"
    assert client.responses.cancel(r.id).status == r.status  # finished: unchanged
    # admitted, it is in progress until it ends
    seen = set()
    slow = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=200,
                                   background=True, extra_body={"ignore_eos": True})
    for _ in range(1000):
        seen.add(client.responses.retrieve(slow.id).status)
        if seen & {"completed", "incomplete"}:
            break
        time.sleep(0.01)
    assert "in_progress" in seen and seen <= {"queued", "in_progress", "completed", "incomplete"}
    # deleted while it runs: stopped (its engine request aborted) and gone for good
    tsrv.engine.pause()
    try:
        gone = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=500,
                                       background=True)
        client.responses.delete(gone.id)
    finally:
        tsrv.engine.resume()
    for _ in range(100):
        if tsrv.metrics()["stepserve:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert tsrv.metrics()["stepserve:num_requests_running"] == 0
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    sync = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(sync.id)
    with pytest.raises(openai.BadRequestError, match="background can only be used when `store` is true"):
        client.responses.create(model=MODEL, input="x", background=True, store=False)


def test_responses_take_the_chat_routes_sampling_extensions(tclient):
    """vLLM's and SGLang's sampling fields (top_k, stop, logit_bias, min_tokens,
    constraints, ...) act on a response as on a chat completion; the chat and
    completions names of what a response names otherwise (max_tokens, n,
    response_format, logprobs) are a 400 naming the field, never ignored."""
    def create(**extra):
        return tclient.responses.create(model=MODEL, input="Tell me of the kings", max_output_tokens=12,
                                        temperature=1.0, extra_body=extra)

    def chat(**extra):
        return tclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me of the kings"}],
                                               max_completion_tokens=12, temperature=1.0, extra_body=extra)

    # the same draw as the chat request it is: top_k 1 (greedy), a seed with min_p, stops, a bias, ignore_eos
    for extra in ({"top_k": 1}, {"min_p": 0.2, "seed": 5}, {"stop": ["e"], "seed": 3},
                  {"logit_bias": {"5": 100}, "seed": 1}, {"ignore_eos": True, "min_tokens": 12, "seed": 2}):
        r, c = create(**extra), chat(**extra)
        assert r.output_text == c.choices[0].message.content, extra
        assert r.usage.output_tokens == c.usage.completion_tokens
    assert "e" not in create(stop=["e"], seed=3).output_text
    assert create(ignore_eos=True, min_tokens=12, seed=2).usage.output_tokens == 12
    assert create(guided_choice=["yea", "nay"], seed=4).output_text in ("yea", "nay")
    assert create(n=1, logprobs=False).output_text  # what their absence means: accepted
    for field, value, hint in (("max_tokens", 3, "max_output_tokens"), ("max_completion_tokens", 3, "max_output_tokens"),
                               ("n", 3, None), ("logprobs", True, None),
                               ("response_format", {"type": "json_object"}, "text.format"),
                               ("bad_words", ["x"], None), ("top_k", "one", None)):
        with pytest.raises(openai.BadRequestError) as e:
            create(**{field: value})
        assert e.value.body["param"] == field, (field, e.value.body)
        assert hint is None or hint in e.value.body["message"]


@pytest.mark.parametrize("kw,param", [
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(input=[{"type": "input_image", "image_url": "x"}]), "input"),
    (dict(truncation="auto"), "truncation"),
])
def test_responses_bad_requests(tclient, kw, param):
    body = dict(model=MODEL, input="hi", max_output_tokens=2)
    extra = {k: kw.pop(k) for k in list(kw) if k in ("conversation",)}
    with pytest.raises(openai.BadRequestError) as e:
        tclient.responses.create(**{**body, **kw}, extra_body=extra or None)
    assert e.value.body["param"] == param


def test_vllm_metric_families(srv, client):
    """The families vLLM's dashboards read, under the stepserve: prefix, move
    with the traffic: a dashboard needs only the prefix changed."""
    before = srv.metrics()
    prompt = "In the beginning God created"
    n_prompt = len(srv.engine.tokenizer.encode(prompt, add_special_tokens=False))
    for _ in range(2):  # the second hits the prefix cache
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=2, seed=1, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    time_ok = False
    for _ in range(50):  # step records reach the metrics on the next scrape
        after = srv.metrics()
        if after.get("stepserve:iteration_tokens_total_sum", 0) - before.get(
                "stepserve:iteration_tokens_total_sum", 0) >= 4 * n_prompt + 20:
            time_ok = True
            break
    assert time_ok

    def d(name):
        return after.get(name, 0) - before.get(name, 0)

    assert d('stepserve:request_success_total{finished_reason="length"}') == 4  # one per choice
    assert d("stepserve:request_generation_tokens_sum") == 20 and d("stepserve:request_generation_tokens_count") == 2
    assert d("stepserve:request_prompt_tokens_sum") == 2 * n_prompt
    assert d("stepserve:prefix_cache_queries_total") == d("stepserve:prefix_cache_queried_tokens_total") > 0
    assert d("stepserve:prefix_cache_hits_total") == d("stepserve:prefix_cache_hit_tokens_total") > 0
    assert "stepserve:num_preemptions_total" in after
    kv_slots = srv.kv_report().capacity  # the pool's slots: 16384 asked for
    assert after[f'stepserve:cache_config_info{{block_size="1",num_gpu_blocks="{kv_slots}"}}'] == 1.0
    assert d("stepserve:iteration_tokens_total_count") >= 5
    # vLLM's count: every generated token, and each choice's whole prompt at its first token (cached or not)
    assert d("stepserve:iteration_tokens_total_sum") == 4 * n_prompt + 20
    assert d("stepserve:request_params_n_sum") == 4 and d("stepserve:request_params_max_tokens_sum") == 10
    # vLLM's per-phase request times: one of each per request; prefill and decode make up inference,
    # which with the wait fits inside the latency the server measured
    phases = ("queue", "prefill", "decode", "inference")
    for ph in phases:
        assert d(f"stepserve:request_{ph}_time_seconds_count") == 2, ph
        assert d(f"stepserve:request_{ph}_time_seconds_sum") >= 0.0, ph
    assert d("stepserve:request_decode_time_seconds_sum") > 0.0
    assert d("stepserve:request_prefill_time_seconds_sum") + d("stepserve:request_decode_time_seconds_sum") \
        == pytest.approx(d("stepserve:request_inference_time_seconds_sum"), abs=1e-6)
    assert d("stepserve:request_queue_time_seconds_sum") + d("stepserve:request_inference_time_seconds_sum") \
        <= d("stepserve:e2e_request_latency_seconds_sum") + 1e-3


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_against_transformers(srv, client, llama_ckpt, route):
    """vLLM's prompt_logprobs: per prompt token (None first) the token itself
    with its logprob and rank, and the top-k with ranks 1..k; checked against
    transformers' log-softmax over the same prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = srv.engine.tokenizer
    text = "In the beginning God created the heaven"
    kw = dict(model=MODEL, max_tokens=1, extra_body={"prompt_logprobs": 2})
    if route == "chat":
        msgs = [{"role": "user", "content": text}]
        r = client.chat.completions.create(messages=msgs, **kw)
        got = r.model_extra["prompt_logprobs"]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        r = client.completions.create(prompt=text, **kw)
        got = r.choices[0].model_extra["prompt_logprobs"]
        ids = tok.encode(text, add_special_tokens=False)
    assert len(got) == len(ids) == r.usage.prompt_tokens and got[0] is None
    hf = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32)
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        ref = logp[p - 1]
        entry = got[p]
        mine = entry[str(ids[p])]
        assert mine["rank"] == int((ref > ref[ids[p]]).sum()) + 1
        assert abs(mine["logprob"] - float(ref[ids[p]])) < 1e-3
        top = sorted(((v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] <= 2))
        assert [t[0] for t in top] == [1, 2]
        want = ref.topk(2)
        assert [t[1] for t in top] == want.indices.tolist()
        assert all(abs(a - b) < 1e-3 for a, b in zip([t[2] for t in top], want.values.tolist()))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=text, max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1}).close()
    assert e.value.body["param"] == "prompt_logprobs"



def test_vllm_and_sglang_request_shapes(srv, client):
    """What their clients send: an empty model name (the served model),
    custom roles the template renders, chat_template_kwargs, SGLang's regex
    field; and what they read: prompt_logprobs null when not asked for, a
    model card with root."""
    r = client.chat.completions.create(model="", messages=[{"role": "my-custom-role", "content": "x"}], max_tokens=2)
    assert r.model == MODEL and r.prompt_logprobs is None
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].prompt_logprobs is None
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert e.value.body["param"] == "chat_template_kwargs"
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10,
                                           temperature=1.0, seed=seed, extra_body={"regex": "(yea|nay)!"})
        assert r.choices[0].message.content in ("yea!", "nay!")
    card = client.models.retrieve(MODEL)
    assert card.model_extra["root"] == srv.engine.info.model
    # usage as vLLM and SGLang send it by default: no prompt_tokens_details (--enable-prompt-tokens-details)
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage == openai.types.CompletionUsage(completion_tokens=3, prompt_tokens=3, total_tokens=6)
    # an id past the vocabulary: a 400 that says so in vLLM's words
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt=[0, 0, 10**6], max_tokens=1)



def test_allowed_token_ids(srv, client):
    allowed = srv.engine.tokenizer.encode(" the earth", add_special_tokens=False)
    for route in ("completions", "chat"):
        kw = dict(model=MODEL, max_tokens=8, temperature=1.0, seed=4, logprobs=True if route == "chat" else 1,
                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        if route == "chat":
            r = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
            toks = [t.token for t in r.choices[0].logprobs.content]
        else:
            r = client.completions.create(prompt="In the beginning", **kw)
            toks = r.choices[0].logprobs.tokens
        assert len(toks) == 8 and set(toks) <= {srv.engine.tokenizer.decode([t]) for t in allowed}
    for body, param in (({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                        ({"allowed_token_ids": [1], "guided_regex": "a"}, "allowed_token_ids")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body=body)
        assert e.value.body["param"] == param



def test_validation_errors_name_the_pydantic_error_type(client):
    """vLLM's clients match on pydantic's error types in the message."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, seed=2**64)
    assert e.value.body["param"] == "seed" and "less_than_equal" in e.value.body["message"]


def test_a_refused_echo_admits_nothing(tsrv, tclient):
    """echo with tool calls is refused before the request is admitted: no
    admission slot and no engine request are left behind."""
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "In the beginning"}]
    with pytest.raises(openai.BadRequestError) as e:
        tclient.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=200,
                                        extra_body={"echo": True, "add_generation_prompt": False,
                                                    "continue_final_message": True})
    assert e.value.body["param"] == "echo"
    assert tsrv.app.state.client.admission.in_flight == 0


# -- beam search (vLLM's use_beam_search on /v1/completions) -------------------------------------------------
def _reference_beams(hf, prompt: list[int], width: int, steps: int, eos: set[int], length_penalty: float):
    """Beam search written out over transformers' log-probabilities: 2 x width
    candidates per beam, an end token completes its beam, rank = logprob /
    (prompt + output tokens) ** length_penalty."""
    import torch

    live, done = [([], 0.0, None)], []

    def rank(b):
        return b[1] / (len(prompt) + len(b[0])) ** length_penalty

    for _ in range(steps):
        grown = []
        for toks, lp, _ in live:
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0, -1].float(), dim=-1)
            top = torch.topk(logp, 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                if t in eos:
                    done.append((toks, lp + v, t))
                else:
                    grown.append((toks + [t], lp + v, None))
        live = sorted(grown, key=rank, reverse=True)[:width]
    return [(toks, end) for toks, _, end in sorted(done + live, key=rank, reverse=True)[:width]]


@pytest.mark.parametrize("length_penalty", [1.0, -2.0])
def test_beam_search_against_a_reference(tsrv, tclient, length_penalty):
    """The beams, best first, are those of a beam search over transformers'
    log-probabilities; copies of a prompt get the same beams (vLLM's test),
    streamed chunks carry the same choices, and usage counts every beam."""
    import torch
    from transformers import AutoModelForCausalLM

    from stepserve.engine.defaults import DEFAULT_MODEL

    tok = tsrv.engine.tokenizer
    text = "Jesus wept"  # an end token is among the first candidates: some beams complete early
    ids = tok.encode(text, add_special_tokens=False)
    kw = dict(model=MODEL, prompt=[text, text], n=3, max_tokens=6, temperature=0.0,
              extra_body={"use_beam_search": True, "length_penalty": length_penalty})
    r = tclient.completions.create(**kw)
    texts = [c.text for c in r.choices]
    got = [(c.text, c.finish_reason, c.stop_reason) for c in r.choices]
    assert [c.index for c in r.choices] == list(range(6)) and got[:3] == got[3:]
    assert len(set(got[:3])) == 3, "beams differ"
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    want = _reference_beams(hf, ids, 3, 6, set(tsrv.engine.info.eos_token_ids), length_penalty)
    assert got[:3] == [(tok.decode(t, skip_special_tokens=True), "length" if end is None else "stop", end)
                       for t, end in want]
    if length_penalty < 0:  # short beams rank first: those an end token completed
        assert got[0][1] == "stop"
    assert r.usage.prompt_tokens == 2 * len(ids)
    assert r.usage.completion_tokens == 2 * sum(len(t) for t, _ in want)
    chunks = list(tclient.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert [(c.choices[0].index, c.choices[0].text) for c in chunks[:-1]] == list(enumerate(texts))
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert tsrv.app.state.client.admission.in_flight == 0


@pytest.mark.parametrize("body,param", [
    (dict(logprobs=1), "logprobs"),
    (dict(stop=["x"]), "stop"),
    (dict(n=11), "n"),
    (dict(echo=True), "echo"),
    (dict(extra_body={"bad_words": ["x"]}), "bad_words"),
    (dict(extra_body={"skip_special_tokens": False}), "skip_special_tokens"),
])
def test_beam_search_refuses_what_it_would_not_honour(tclient, body, param):
    extra = {"use_beam_search": True, **body.pop("extra_body", {})}
    with pytest.raises(openai.BadRequestError) as e:
        tclient.completions.create(model=MODEL, prompt="x", max_tokens=2, **body, extra_body=extra)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:  # chat has no beam search
        tclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                        extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search"
    # a field newer than this server changes nothing under beam search either (it raised KeyError, a 500)
    r = tclient.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2,
                                   extra_body={"use_beam_search": True, "some_future_field": 1})
    assert len(r.choices) == 2


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_include_stop_str_in_output_and_skip_special_tokens(client, llama_ckpt, route):
    """vLLM's include_stop_str_in_output keeps the matched stop string in the
    text, streamed or not; skip_special_tokens=false shows special tokens'
    text (here the end token, forced and ignored)."""
    from transformers import AutoTokenizer

    def run(stream=False, **kw):
        extra = {k: kw.pop(k) for k in ("include_stop_str_in_output", "skip_special_tokens", "ignore_eos") if k in kw}
        args = dict(model=MODEL, temperature=0.0, extra_body=extra, **kw)
        if route == "chat":
            out = client.chat.completions.create(messages=[{"role": "user", "content": "Tell me of the earth."}],
                                                 stream=stream, **args)
            if stream:
                return "".join(c.choices[0].delta.content or "" for c in out if c.choices)
            return out.choices[0].message.content
        out = client.completions.create(prompt="In the beginning", stream=stream, **args)
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    full = run(max_tokens=16, ignore_eos=True)
    stop = full[6:9]
    cut = full.find(stop)
    assert stop.strip() and cut >= 0
    for stream in (False, True):
        assert run(stream, max_tokens=16, ignore_eos=True, stop=[stop]) == full[:cut]
        assert run(stream, max_tokens=16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True) \
            == full[:cut] + stop
    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    eos = tok.eos_token_id
    forced = dict(max_tokens=3, ignore_eos=True, logit_bias={str(eos): 100})
    assert run(**forced) == ""
    for stream in (False, True):
        assert run(stream, skip_special_tokens=False, **forced) == tok.decode([eos] * 3) != ""


# -- SGLang's /generate -----------------------------------------------------------------------------------------
def _gen(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=60)


def _gen_stream(srv, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", srv.url + "/generate", headers={"Authorization": f"Bearer {KEY}"},
                      json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                if line == "data: [DONE]":
                    events.append("[DONE]")
                    break
                events.append(json.loads(line[5:]))
    return events


def test_sglang_generate_request_and_answer(srv, llama_ckpt):
    """SGLang's client sends its sampling names (max_new_tokens, min_new_tokens,
    no_stop_trim) and reads `text`, `output_ids` and `meta_info`: its finish
    reason, token counts and the request's `rid`; streamed, the text and ids
    so far in every event, then [DONE]."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_ckpt)
    ref = _native_greedy(srv, tok.encode("In the beginning", add_special_tokens=False), 12)
    # as SGLang's bench_serving sends it
    body = {"text": "In the beginning", "rid": "my-request", "lora_path": None, "return_logprob": False,
            "return_routed_experts": False, "logprob_start_len": -1, "sampling_params": {
                "max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    r = _gen(srv, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref == out["outputs"][0]["token_ids"]
    assert out["text"] == out["outputs"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["id"] == "my-request" == out["id"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(tok("In the beginning").input_ids), 12)
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    events = _gen_stream(srv, body)
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1] == out["text"]
    assert events[-2]["output_ids"] == ref and events[-2]["meta_info"]["finish_reason"] == meta["finish_reason"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])
    # a stop string: matched, trimmed unless no_stop_trim; an end token: matched as its id
    whole = out["text"]
    stop = whole[5:8]
    cut = whole.find(stop)
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    got = _gen(srv, {"text": "In the beginning", "sampling_params": sp}).json()
    assert got["text"] == whole[:cut] and got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    got = _gen(srv, {"text": "In the beginning", "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert got["text"] == whole[:cut] + stop
    eos = tok.eos_token_id
    got = _gen(srv, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "logit_bias": {str(eos): 100},
                                                                "min_new_tokens": 2}}).json()
    assert got["output_ids"][-1] == eos and len(got["output_ids"]) == 3
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_sglang_generate_logprobs(srv):
    """return_logprob with top_logprobs_num and logprob_start_len: SGLang's
    [logprob, token id, text] entries, the output's and the prompt's from
    that position, equal to the native route's logprobs."""
    prompt = [5, 6, 7, 8, 9]
    native = _gen(srv, {"input_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                                 "logprobs": 2, "prompt_logprobs": 2}}).json()
    body = {"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                                "ignore_eos": True}}
    for out in (_gen(srv, body).json(), _gen_stream(srv, body)[-2]):
        meta = out["meta_info"]
        want = native["outputs"][0]["logprobs"]
        assert [e[1] for e in meta["output_token_logprobs"]] == out["output_ids"] == [w["token_id"] for w in want]
        assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx([w["logprob"] for w in want], abs=1e-4)
        assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
        assert [[t[1] for t in top] for top in meta["output_top_logprobs"]] == [[t for t, _ in w["top"]] for w in want]
        plp = native["prompt_logprobs"]
        assert [e[1] for e in meta["input_token_logprobs"]] == prompt[2:]
        assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx([p["logprob"] for p in plp[2:]], abs=1e-4)
        assert len(meta["input_top_logprobs"]) == 3 and all(len(t) == 2 for t in meta["input_top_logprobs"])
    out = _gen(srv, {**body, "logprob_start_len": 0, "top_logprobs_num": 0, "return_text_in_logprobs": False}).json()
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0] == [None, 5, None] and len(meta["input_token_logprobs"]) == 5
    assert "output_top_logprobs" not in meta and "input_top_logprobs" not in meta
    assert out["outputs"][0]["logprobs"] is None and out["prompt_logprobs"] is None
    assert "input_token_logprobs" not in _gen(srv, {**body, "logprob_start_len": -1}).json()["meta_info"]


def test_sglang_generate_constraints(srv):
    """SGLang's regex and its json_schema as JSON text."""
    for seed in range(3):
        out = _gen(srv, {"text": "x", "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "seed": seed,
                                                          "regex": "(yea|nay)!"}}).json()
        assert out["text"] in ("yea!", "nay!")
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    out = _gen(srv, {"text": "x", "sampling_params": {"max_new_tokens": 20, "temperature": 1.0, "seed": 1,
                                                      "json_schema": json.dumps(schema)}}).json()
    assert json.loads(out["text"])["a"] in ("x", "y")


@pytest.mark.parametrize("body,param", [
    ({"sampling_params": {"max_tokens": 4, "max_new_tokens": 4}}, "sampling_params"),
    ({"sampling_params": {"min_tokens": 1, "min_new_tokens": 1}}, "sampling_params"),
    ({"sampling_params": {"ebnf": "root ::= \"a\""}}, "sampling_params.ebnf"),
    ({"sampling_params": {"spaces_between_special_tokens": False}}, "sampling_params.spaces_between_special_tokens"),
    ({"sampling_params": {"json_schema": "{not json"}}, "sampling_params.json_schema"),
    ({"sampling_params": {"regex": "(", "max_new_tokens": 2}}, "sampling_params.regex"),
    ({"sampling_params": {"regex": "a", "json_schema": {}}}, "sampling_params"),
    ({"sampling_params": {"max_new_tokens": 10 ** 6}}, "sampling_params.max_new_tokens"),
    ({"lora_path": "x"}, "lora_path"),
    ({"image_data": ["x.png"]}, "image_data"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"text": ["a", "b"]}, "text"),
    ({"return_logprob": True, "sampling_params": {"logprobs": 1}}, None),
    ({"top_logprobs_num": 100}, "top_logprobs_num"),
])
def test_sglang_generate_refusals(srv, body, param):
    r = _gen(srv, {"text": "x", **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.json()


def test_sglang_view_only_for_one_output(srv):
    """With n > 1 (SGLang answers a list) or stages the answer is the native one alone."""
    out = _gen(srv, {"text": "x", "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 1.0}}).json()
    assert len(out["outputs"]) == 2 and "text" not in out and "meta_info" not in out


def test_a_native_stream_stays_deltas(srv):
    """A request in the native route's own terms streams deltas only (SGLang's
    view would resend the whole text and ids in every event); its whole
    answer still carries SGLang's view."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    events = _gen_stream(srv, body)
    assert events[-1] == "[DONE]" and all("text" not in e and "meta_info" not in e for e in events[:-1])
    streamed = [t for e in events[:-1] for o in e["outputs"] for t in o["token_ids"]]
    whole = _gen(srv, body).json()
    assert streamed == whole["outputs"][0]["token_ids"] == whole["output_ids"]
    # one SGLang name is enough for SGLang's stream
    events = _gen_stream(srv, {**body, "rid": "r"})
    assert events[-2]["output_ids"] == streamed and events[-2]["meta_info"]["id"] == "r"
