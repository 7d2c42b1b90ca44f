"""Text prompts get the tokenizer's special tokens (a BOS), as transformers,
vLLM and SGLang tokenize them, while a rendered chat template keeps only its
own; vLLM's `add_special_tokens` turns that either way; and vLLM's
`POST /tokenize` and `/detokenize` give the ids the generation routes use.
On a checkpoint whose tokenizer adds a BOS, checked against the tokenizer
itself (transformers)."""

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from server_util import ServerThread
from stepserve import LLM, SamplingParams

MODEL = "bos-model"
TEXT = "In the beginning God created"
CHAT = [{"role": "user", "content": "Tell me of the earth."}]


@pytest.fixture(scope="module")
def bos_ckpt(ckpt_factory):
    return ckpt_factory("llama", bos=True)


@pytest.fixture(scope="module")
def tok(bos_ckpt):
    t = AutoTokenizer.from_pretrained(bos_ckpt)
    assert t(TEXT).input_ids[0] == t.bos_token_id != t.encode(TEXT, add_special_tokens=False)[0]
    return t


@pytest.fixture(scope="module")
def srv(bos_ckpt):
    with ServerThread(bos_ckpt, served_model_name=MODEL, kv_slots=8192, max_running=16) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def _chat_ids(tok, messages, **kw) -> list[int]:
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_tokenize_a_prompt_as_the_tokenizer_does(srv, tok):
    r = _post(srv, "/tokenize", {"model": MODEL, "prompt": TEXT})
    assert r.status_code == 200, r.text
    want = tok(TEXT).input_ids
    assert r.json() == {"count": len(want), "max_model_len": 512, "tokens": want, "token_strs": None}
    r = _post(srv, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    plain = tok.encode(TEXT, add_special_tokens=False)
    assert r.json()["tokens"] == plain == want[1:]
    assert r.json()["token_strs"] == tok.convert_ids_to_tokens(plain)


def test_tokenize_messages_as_chat_renders_them(srv, tok):
    r = _post(srv, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == _chat_ids(tok, CHAT)
    r = _post(srv, "/tokenize", {"messages": CHAT + [{"role": "assistant", "content": "The earth"}],
                                 "continue_final_message": True})
    assert r.json()["tokens"] == tok.encode(
        tok.apply_chat_template(CHAT + [{"role": "assistant", "content": "The earth"}], tokenize=False,
                                continue_final_message=True), add_special_tokens=False)
    r = _post(srv, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    assert r.json()["tokens"] == [tok.bos_token_id] + _chat_ids(tok, CHAT)


def test_generation_routes_use_the_ids_tokenize_gives(srv, client, tok):
    """A completion's prompt tokens are the tokenizer's (BOS first), and its
    text is that of the same ids given as ids; without special tokens, that
    of the ids without the BOS. Chat's prompt is the template's alone."""
    kw = dict(model=MODEL, max_tokens=8, temperature=0.0)
    with_bos, without = tok(TEXT).input_ids, tok.encode(TEXT, add_special_tokens=False)
    out = client.completions.create(prompt=TEXT, **kw)
    assert out.usage.prompt_tokens == len(with_bos)
    assert out.choices[0].text == client.completions.create(prompt=with_bos, **kw).choices[0].text
    out = client.completions.create(prompt=TEXT, extra_body={"add_special_tokens": False}, **kw)
    assert out.usage.prompt_tokens == len(without)
    assert out.choices[0].text == client.completions.create(prompt=without, **kw).choices[0].text
    chat = client.chat.completions.create(messages=CHAT, **kw)
    assert chat.usage.prompt_tokens == len(_chat_ids(tok, CHAT))
    chat = client.chat.completions.create(messages=CHAT, extra_body={"add_special_tokens": True}, **kw)
    assert chat.usage.prompt_tokens == len(_chat_ids(tok, CHAT)) + 1
    # the native route too (as SGLang's tokenizes a text)
    r = _post(srv, "/generate", {"text": TEXT, "sampling_params": {"max_tokens": 8, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == with_bos


def test_detokenize(srv, tok):
    ids = tok(TEXT).input_ids
    r = _post(srv, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}
    assert _post(srv, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": TEXT, "messages": CHAT}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": TEXT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
])
def test_bad_tokenize_requests_are_400s(srv, path, body, param):
    r = _post(srv, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def test_an_unknown_model_is_a_404(srv):
    for path, body in (("/tokenize", {"prompt": TEXT}), ("/detokenize", {"tokens": [1]})):
        r = _post(srv, path, {**body, "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_python_api_text_prompts_get_the_bos(bos_ckpt, tok):
    llm = LLM(bos_ckpt, kv_slots=2048)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = llm.generate([TEXT], sp)[0]
    assert out.prompt_token_ids == tok(TEXT).input_ids
    assert out.outputs[0].token_ids == llm.generate([tok(TEXT).input_ids], sp)[0].outputs[0].token_ids
