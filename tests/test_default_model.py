"""The embedded default model: loads with no arguments, speaks KJV English,
answers chat requests and ends its turn; the draft shares its tokenizer."""

import os
import re

import pytest

from stepserve import LLM, SamplingParams
from stepserve.engine.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL

pytestmark = [
    pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_MODEL, "config.json")),
                       reason="embedded model not present in this checkout"),
    pytest.mark.cpu_paths,  # dtype=auto decides per CPU: run again as an AVX2-only CPU
]

KJV_WORDS = {"the", "and", "of", "unto", "lord", "god", "he", "that", "shall", "his", "them", "said", "thou",
             "thee", "thy", "i", "is", "in", "to", "a", "be", "for", "which", "they", "all", "not", "with",
             "was", "my", "me", "ye", "him", "it", "will", "are", "upon", "israel", "people", "son", "sons",
             "children", "king", "hath", "have", "from", "by", "their", "were", "there", "this", "o", "man"}


@pytest.fixture(scope="module")
def llm():
    return LLM()


def test_speaks_kjv_english(llm):
    outs = llm.generate(["And God said", "The LORD is my shepherd"], SamplingParams(max_tokens=48, temperature=0))
    for o in outs:
        words = re.findall(r"[a-z]+", o.outputs[0].text.lower())
        assert len(words) >= 10
        common = sum(w in KJV_WORDS for w in words)
        assert common >= 0.4 * len(words), o.outputs[0].text


def test_chat_ends_its_turn(llm):
    msgs = [{"role": "user", "content": "In the beginning God created the heaven and the earth."}]
    o = llm.chat(msgs, SamplingParams(max_tokens=120, temperature=0))[0].outputs[0]
    assert o.finish_reason == "stop"
    assert "<|im_end|>" not in o.text and len(o.text.split()) >= 3


def test_draft_shares_the_tokenizer():
    target, draft = LLM(), LLM(DEFAULT_DRAFT_MODEL)
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert draft.engine.model_config.vocab_size == target.engine.model_config.vocab_size
    n_target = sum(p.numel() for p in target.engine.model.parameters())
    n_draft = sum(p.numel() for p in draft.engine.model.parameters())
    assert n_draft < n_target / 3
