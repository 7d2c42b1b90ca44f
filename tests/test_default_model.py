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


def test_stop_strings_wait_for_min_tokens(llm):
    """On the embedded model's English text: as in vLLM, a stop string ends a branch only once it has more than
    min_tokens tokens (the earliest a stop token or EOS may come): one
    completed earlier is output text. Checked against the greedy text's
    prefixes: the first token past min_tokens whose new text completes the
    stop string ends it."""
    full = llm.generate(["In the beginning God"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    toks = full[0].outputs[0].token_ids
    texts = [llm.tokenizer.decode(toks[:j]) for j in range(len(toks) + 1)]
    # the most frequent short word: it completes several times over the output
    words = texts[-1].split()
    stop = " " + max(set(words), key=words.count)
    ends = [j for j in range(1, len(toks) + 1)
            if texts[j].find(stop, max(len(texts[j - 1]) - len(stop) + 1, 0)) >= 0]
    assert len(ends) >= 2, (stop, texts[-1])
    for min_tokens in (0, ends[0], ends[0] + 1, ends[1]):
        j = next((e for e in ends if e > min_tokens), None)
        got = llm.generate(["In the beginning God"], SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, stop=[stop], min_tokens=min_tokens))[0].outputs[0]
        if j is None:
            assert got.finish_reason == "length" and got.token_ids == toks
            continue
        cut = texts[j].find(stop, max(len(texts[j - 1]) - len(stop) + 1, 0))
        assert (got.finish_reason, got.stop_reason, got.token_ids, got.text) == (
            "stop", stop, toks[:j], texts[j][:cut]), min_tokens


def test_draft_shares_the_tokenizer():
    target, draft = LLM(), LLM(DEFAULT_DRAFT_MODEL)
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert draft.engine.model_config.vocab_size == target.engine.model_config.vocab_size
    n_target = sum(p.numel() for p in target.engine.model.parameters())
    n_draft = sum(p.numel() for p in draft.engine.model.parameters())
    assert n_draft < n_target / 3


def test_load_tokenizer_gives_what_auto_tokenizer_gives(tmp_path):
    """`load_tokenizer` hands AutoTokenizer a plain config where the tokenizer
    class is named (it skips loading the model's config class, ~1 s); the
    tokenizer must be the one AutoTokenizer picks on its own. And a directory
    whose tokenizer_config.json names no class takes AutoTokenizer's own path."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from stepserve.engine.engine import _plain_model_config, load_tokenizer

    plain = tmp_path / "plain"
    shutil.copytree(DEFAULT_MODEL, plain)
    cfg_path = plain / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["tokenizer_class"]
    cfg_path.write_text(json.dumps(cfg))
    assert _plain_model_config(DEFAULT_MODEL) is not None and _plain_model_config(str(plain)) is None
    texts = ["In the beginning God created", "<|im_start|>user\nhi<|im_end|>", "  odd   spacing\tand ümlauts"]
    msgs = [{"role": "user", "content": "And God said"}]
    for path in (DEFAULT_MODEL, str(plain)):
        ours, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert type(ours) is type(ref)
        assert ours.get_vocab() == ref.get_vocab()
        assert ours.all_special_tokens == ref.all_special_tokens
        assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (ref.eos_token_id, ref.bos_token_id,
                                                                             ref.pad_token_id)
        for t in texts:
            for special in (False, True):
                assert ours.encode(t, add_special_tokens=special) == ref.encode(t, add_special_tokens=special)
        assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def test_an_engine_starts_without_torch_compile_machinery():
    """Building the model runs no torch decomposition (they import torch._dynamo
    and sympy on first use: 1.5-2 s of every `LLM()` and server start, for
    random init and meta tensors the checkpoint overwrites), and the tokenizer
    does not load transformers' model classes (torch.distributed.tensor with
    them, ~1 s). Checked in a fresh interpreter, against what `import torch`
    alone already imports."""
    import subprocess
    import sys

    heavy = ["torch._dynamo", "sympy", "torch.distributed.tensor"]
    code = ("import sys, torch\n"
            f"pre = [m for m in {heavy!r} if m in sys.modules]\n"
            "from stepserve import LLM, SamplingParams\n"
            "LLM().generate(['In the beginning'], SamplingParams(max_tokens=2))\n"
            f"print([m for m in {heavy!r} if m in sys.modules and m not in pre])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
