"""Fuzz the API from its own OpenAPI schema with schemathesis: valid and
invalid bodies for every operation, a bounded number of examples each; no
response may be a 5xx, and the server must be serving and leak-free after."""

import pytest

schemathesis = pytest.importorskip("schemathesis")

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server_util import ServerThread  # noqa: E402

MAX_EXAMPLES = 50  # per operation and mode
# generation must stay cheap on CPU: bound what makes a request long (the
# limits themselves are covered one by one in test_server_errors)
BOUNDS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}


def _bound(node):
    if isinstance(node, dict):
        props = node.get("properties")
        if isinstance(props, dict):
            for name, limit in BOUNDS.items():
                if name in props:
                    for branch in props[name].get("anyOf", [props[name]]):
                        if branch.get("type") == "integer":
                            branch["maximum"] = limit
        for v in node.values():
            _bound(v)
    elif isinstance(node, list):
        for v in node:
            _bound(v)


@pytest.fixture(scope="module")
def srv(llama_ckpt):
    # a short context: chat without max_tokens generates to the end of it
    with ServerThread(llama_ckpt, served_model_name="fuzz-model", kv_slots=8192, max_running=16,
                      max_model_len=96) as s:
        yield s


@pytest.fixture(scope="module")
def schema(srv):
    raw = srv.app.openapi()
    _bound(raw)
    return schemathesis.openapi.from_dict(raw)


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
CASES = [(m, p, mode) for m, p in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                   ("POST", "/generate")] for mode in (POSITIVE, NEGATIVE)]
CASES.append(("GET", "/v1/models/{model}", POSITIVE))  # a free-form path parameter has no invalid values


@pytest.mark.parametrize("method,path,mode", CASES, ids=lambda v: str(v))
def test_fuzz_no_server_errors(srv, schema, method, path, mode):
    statuses = {}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=schema[path][method].as_strategy(generation_mode=mode))
    def check(case):
        resp = case.call(base_url=srv.url, timeout=60)
        assert resp.status_code < 500, (case.body, resp.text[:500])
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

    check()
    assert statuses
    if mode is NEGATIVE:
        assert set(statuses) <= {400, 404}, statuses  # nothing invalid slips through (404: unknown model)
    srv.wait_idle()
    srv.assert_kv_clean()
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
