import math

import pytest

from stepserve.engine.sampling_params import SamplingParams


def test_defaults_are_valid_and_match_vllm():
    p = SamplingParams()
    assert p.validate() is p
    assert p.validate(vocab_size=32000) is p
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.logprobs is None and p.logit_bias is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert not p.greedy and not p.needs_penalties


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": 2.0001}, "frequency_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 3}, "stop_token_ids"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"seed": "42"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": 2**63}, "seed"),  # a 64-bit signed seed, as on the HTTP routes (5 + 2**64 drew as 5 did)
        ({"seed": -(2**63) - 1}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_bad_values_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        SamplingParams(**kwargs)


def test_vocab_dependent_checks():
    p = SamplingParams(stop_token_ids=[99], logit_bias={99: 5.0})
    p.validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"^stop_token_ids"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"^logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate(vocab_size=100)
    # top_k larger than the vocabulary is allowed (the sampler clamps it)
    SamplingParams(top_k=1000).validate(vocab_size=100)


def test_boundary_values_are_accepted():
    SamplingParams(
        n=4,
        max_tokens=None,
        min_tokens=5,
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
        logit_bias={0: -100, 5: 100},
        seed=-(2**63),
    )
    SamplingParams(seed=2**63 - 1)
    SamplingParams(max_tokens=1, logprobs=0, top_p=1e-9, min_p=0.0)


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    # OpenAI clients send logit_bias keys as JSON strings
    assert SamplingParams(logit_bias={"50256": -100, 7: 2.5}).logit_bias == {50256: -100, 7: 2.5}


def test_validate_rechecks_after_mutation():
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(ValueError, match=r"^temperature"):
        p.validate()


def test_properties():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1, temperature=0.8).greedy
    assert not SamplingParams(temperature=0.8, top_k=2).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={3: 1.0}, seed=7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(2)
    q.logit_bias[4] = 2.0
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {3: 1.0}
