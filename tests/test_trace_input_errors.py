"""A mistake in a trace file, a synthetic spec or a profile is a ValueError
that names the file (and its line) or the spec, and the field -- which the CLI
prints as one `stepserve: ...` line -- never a KeyError, an IndexError or a
TypeError from inside a loader, and never a request dropped or read as
something else (found by fuzzing)."""

from __future__ import annotations

import json
import re

import pytest

from stepserve.scheduler.latency_model import load_profile
from stepserve.scheduler.roofline import roofline_profile
from stepserve.traces.load import load_trace, save_trace
from stepserve.traces.scaling import Scaling, apply_scaling
from stepserve.traces.synthetic import SyntheticConfig, generate

AZ_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZ_OK = "2023-11-16 18:15:46.6805900,374,44\n"


def _refused(path, line: int | None, says: str):
    """load_trace(path) is a ValueError naming the file, the line and `says` (the field)."""
    with pytest.raises(ValueError) as e:
        load_trace(str(path))
    msg = str(e.value)
    assert str(path) in msg and says in msg, msg
    if line is not None:
        assert f"line {line}" in msg, msg


# -- Azure CSV ---------------------------------------------------------------------


@pytest.mark.parametrize("row,says", [
    ("2023-11-16 18:15:50.9951690,396\n", "GeneratedTokens"),  # a short row
    ("2023-11-16 18:15:50.9951690\n", "ContextTokens"),
    ("2023-11-16 18:15:50.9951690,396,44,7\n", "more fields"),  # a long row
    ("2023-11-16 18:15:50.9951690,-374,44\n", "ContextTokens"),  # was silently 1
    ("2023-11-16 18:15:50.9951690,374,-44\n", "GeneratedTokens"),
    ("2023-11-16 18:15:50.9951690,374.5,44\n", "ContextTokens"),
    ("2023-11-16 18:15:50.9951690,abc,44\n", "ContextTokens"),
    ("nan,396,109\n", "TIMESTAMP"),
])
def test_azure_row_mistakes_name_file_line_and_column(tmp_path, row, says):
    p = tmp_path / "az.csv"
    p.write_text(AZ_HEAD + AZ_OK + row)
    _refused(p, 3, says)


# -- Mooncake JSONL ----------------------------------------------------------------

MC_OK = {"timestamp": 0, "input_length": 100, "output_length": 6, "hash_ids": [1]}


@pytest.mark.parametrize("line,says", [
    ('{"timestamp": 0, "output_length": 6, "hash_ids": [1]}', "input_length"),  # was a KeyError
    ('{"timestamp": 0, "input_length": 100, "hash_ids": [1]}', "output_length"),
    ('{"input_length": 100, "output_length": 6, "hash_ids": [1]}', "timestamp"),
    ("[1, 2, 3]", "object"),  # was an AttributeError
    ('{"timestamp": 0, "input_length": -100, "output_length": 6, "hash_ids": [1]}', "input_length"),  # was 1
    ('{"timestamp": 0, "input_length": 100, "output_length": -6, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": 0, "input_length": 100.5, "output_length": 6, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "input_length": 100, "output_length": 6, "hash_ids": "abc"}', "hash_ids"),  # was 'a','b','c'
    ('{"timestamp": 0, "input_length": 100, "output_length": 6, "hash_ids": [1, "x"]}', "hash_ids"),
    ('{"timestamp": NaN, "input_length": 100, "output_length": 6, "hash_ids": [2]}', "timestamp"),  # was dropped
    ('{"timestamp": Infinity, "input_length": 100, "output_length": 6, "hash_ids": [2]}', "timestamp"),
    ('{"timestamp": "x", "input_length": 100, "output_length": 6, "hash_ids": [2]}', "timestamp"),
    ('{"timestamp": 1' + "0" * 400 + ', "input_length": 100, "output_length": 6}', "timestamp"),  # an OverflowError
    ('{"timestamp": 0, "input_length": 100', "JSON"),  # a cut-off line
])
def test_mooncake_line_mistakes_name_file_line_and_field(tmp_path, line, says):
    p = tmp_path / "mc.jsonl"
    p.write_text(json.dumps(MC_OK) + "\n" + line + "\n")
    _refused(p, 2, says)


# -- stepserve JSONL ---------------------------------------------------------------

SS_OK = {"request_id": "a", "arrival_s": 0, "output_len": 8, "segments": [["k", 10]]}


@pytest.mark.parametrize("change,says", [
    ({"output_len": None}, "output_len"),  # missing: was a KeyError
    ({"request_id": None}, "request_id"),
    ({"arrival_s": None}, "arrival_s"),
    ({"segments": None}, "segments"),
    ({"n": -3}, "n"),  # was an IndexError
    ({"n": 0}, "n"),  # was accepted
    ({"n": 2.5}, "n"),
    ({"output_len": -8}, "output_len"),  # was accepted
    ({"output_len": 0}, "output_len"),
    ({"segments": [["k", -10]]}, "segments"),  # was accepted
    ({"segments": [["k", 0]]}, "segments"),
    ({"segments": [["k"]]}, "segments"),
    ({"segments": "kk"}, "segments"),
    ({"segments": []}, "segments"),  # was accepted, then '0/1 completed'
    ({"arrival_s": float("nan")}, "arrival_s"),  # was dropped
    ({"arrival_s": float("inf")}, "arrival_s"),
    ({"arrival_s": "soon"}, "arrival_s"),
    ({"meta": "abc"}, "meta"),
    ({"stages": [[[["s", 4], 0]]]}, "stages"),  # a branch of 0 tokens: was '0/1 completed'
    ({"stages": [[[["s", -4], 3]]]}, "stages"),
    ({"stages": [[]]}, "stages"),
    ({"stages": [[[["s", 4], 3]]], "n": 2}, "n"),  # fork/join requests take n = 1
])
def test_stepserve_line_mistakes_name_file_line_and_field(tmp_path, change, says):
    bad = {k: v for k, v in {**SS_OK, "request_id": "b", **change}.items() if v is not None}
    p = tmp_path / "ss.jsonl"
    # json.dumps writes NaN and Infinity as Python's json reads them back
    p.write_text(json.dumps(SS_OK) + "\n" + json.dumps(bad) + "\n")
    _refused(p, 2, says)


@pytest.mark.parametrize("line,says", [("{garbage", "JSON"), ("[1, 2]", "object")])
def test_stepserve_lines_that_are_not_objects(tmp_path, line, says):
    p = tmp_path / "ss.jsonl"
    p.write_text(json.dumps(SS_OK) + "\n\n" + line + "\n")
    _refused(p, 3, says)  # blank lines count


# -- what selects a synthetic spec -------------------------------------------------


def test_only_the_synthetic_colon_prefix_selects_a_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "synthetic_trace.jsonl").write_text(json.dumps(MC_OK) + "\n")  # was parsed as a spec
    t = load_trace("synthetic_trace.jsonl")
    assert t.source == "mooncake" and len(t.specs) == 1
    for not_a_spec in ("synthetic_foo:num=5", "synthetic", "synthetics:num=5"):  # was a spec, or an IndexError
        with pytest.raises((ValueError, OSError), match="not found"):
            load_trace(not_a_spec)
    with pytest.raises(ValueError, match="synthetic_foo"):
        SyntheticConfig.parse("synthetic_foo:num=5")
    assert load_trace("synthetic:num=3").source == "synthetic"


# -- synthetic specs ---------------------------------------------------------------


@pytest.mark.parametrize("spec,says", [
    ("branch_fraction=1,branches=0", "branches"),  # was an IndexError
    ("branch_fraction=1,branches=-2", "branches"),
    ("num=5,num=7", "num"),  # was the last one, silently
    ("turns=2,turn_gap_s=nan", "turn_gap_s"),  # was half the requests dropped
    ("turns=2,turn_gap_s=inf", "turn_gap_s"),
    ("turns=2,turn_gap_s=-1", "turn_gap_s"),  # was numpy's 'scale < 0'
    ("prefix_groups=-2,prefix_len=4", "prefix_groups"),  # was numpy's 'high <= 0'
    ("seed=-1", "seed"),  # was numpy's 'expected non-negative integer'
    ("num=0", "num"),
    ("turns=0", "turns"),
    ("num=abc", "num"),
    ("rate=fast", "rate"),
    ("input=fixed:0", "input"),
    ("fork_fraction=1,fork_branches=0", "fork_branches"),
])
def test_synthetic_spec_mistakes_name_the_key(spec, says):
    with pytest.raises(ValueError) as e:
        generate(SyntheticConfig.parse("synthetic:" + spec))
    assert re.search(rf"\b{says}\b", str(e.value)), str(e.value)


def test_a_zero_token_fork_suffix_is_honoured(tmp_path):
    """fork_suffix=fixed:0 passed validation, then every suffix was drawn as 1
    token: branches with no suffix of their own (the engine takes an empty
    one) keep 0, through scaling and a saved trace."""
    specs = generate(SyntheticConfig.parse("synthetic:num=5,fork_fraction=1,fork_branches=3,fork_suffix=fixed:0"))
    suffixes = [seg.length for s in specs for st in s.stages for seg, _ in st if seg is not None]
    assert suffixes and set(suffixes) == {0}
    scaled, _ = apply_scaling(specs, Scaling(input_scale=0.5))
    assert {seg.length for s in scaled for st in s.stages for seg, _ in st if seg is not None} == {0}
    p = tmp_path / "fs0.jsonl"
    save_trace(specs, str(p))
    assert load_trace(str(p)).specs == specs


# -- profiles ----------------------------------------------------------------------


@pytest.mark.parametrize("content,says", [
    ("[1, 2, 3]", "object"),  # was an AttributeError
    ('"h100:llama3-8b"', "object"),
    ('{"kind": "stepserve-latency-profile", "version": 1}', "latency"),  # was a KeyError
    ('{"kind": "stepserve-latency-profile", "latency": [1]}', "latency"),
    ('{"kind": "stepserve-latency-profile", "latency": {"a": 1}}', "form"),
    ('{"kind": "stepserve-latency-profile", "latency": {"form": "roofline"}, "engine": 3}', "engine"),
    ('{"kind": "stepserve-latency-profile"', "JSON"),
])
def test_profile_file_mistakes_name_the_file(tmp_path, content, says):
    p = tmp_path / "prof.json"
    p.write_text(content)
    with pytest.raises(ValueError) as e:
        load_profile(str(p))
    assert str(p) in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["h100x0:llama3-8b", "a10x00:llama2-70b"])
def test_a_roofline_group_of_no_devices_is_refused(name):
    """h100x0 was a ZeroDivisionError; the name is refused as what it is, not
    as 'no such file'."""
    for build in (roofline_profile, load_profile):
        with pytest.raises(ValueError, match=re.escape(repr(name)) + ".*at least 1"):
            build(name)
