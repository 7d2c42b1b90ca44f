"""The engine's features compose. Whatever the configuration -- speculative
decoding (n-gram lookup; a draft model that is mostly rejected, or the target
as its own draft, mostly accepted; fixed or adaptive lengths), branch
admission (eager, off, cap:N, TAPER), a small KV pool (retraction), a small
token budget (chunked prefill), a running cap, the admission order, the
prefix cache on or off -- and whatever the workload -- shared prefixes,
n > 1, fork/join requests with a parallel and a serial stage, stop tokens,
stop strings, min_tokens, prompt logprobs (a full prefill past the cache),
a logits processor that reads the output (as a grammar does), requests that
opt out of speculation, staggered arrivals, aborts, and the
same workload again on the warm engine, the overlap schedule (without
speculation), the GPU path's backend (flashinfer's plans and fused kernels,
the decode graphs' static buffers, against the fake flashinfer, whose
kernels fail a launch over no rows as CUDA does) -- every request that is not aborted
gets exactly the tokens, finish reasons, stop reasons and text that a plain
reference engine gives it, an aborted one a prefix of its tokens, and the KV
pool is whole again at the end. The KV integrity check runs after every step
(check_invariants).

Speculation is exact for greedy rows and for the sampled rows of requests
that give their seed (every request here does): such a row draws each
position as the sampler does, keyed on (seed, position, token), so its
tokens depend neither on the draft lengths nor on the batch."""

from __future__ import annotations

import itertools
import json
import sys
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import fake_flashinfer
from processors import NoRepeat
from stepserve import SamplingParams
from stepserve.engine.engine import Engine, EngineConfig
from stepserve.scheduler.latency_model import PROFILE_KIND

MAX_NEW = 12
# tokens the llama test checkpoint (seed 0) often generates, so that stop tokens end some branches early;
# were the checkpoint to change, stops would only hit less often
STOP_CANDIDATES = (265, 35, 182, 116, 154, 282)

_ids = itertools.count()  # request ids, unique across examples


@pytest.fixture(scope="module")
def reference_engine(llama_ckpt):
    return Engine(EngineConfig(model=llama_ckpt))


@pytest.fixture(scope="module")
def draft_ckpt(ckpt_factory):
    # a different random model: its drafts are mostly rejected (the target as its own draft: mostly accepted)
    return ckpt_factory("llama", seed=1, layers=1)


@pytest.fixture(scope="module")
def slow_profile(tmp_path_factory):
    """A step model whose decode rows cost 10 ms each: against a 15 ms TPOT SLO
    TAPER keeps only the baseline rows (as in test_branch_admission)."""
    prof = {"kind": PROFILE_KIND, "source": "measured",
            "latency": {"form": "linear", "coef": [1e-3, 1e-2, 0.0, 0.0]}}
    path = tmp_path_factory.mktemp("profile") / "slow.json"
    path.write_text(json.dumps(prof))
    return str(path)


# -- the workload ---------------------------------------------------------------------

tokens = st.lists(st.integers(3, 380), min_size=1, max_size=24)
suffix = st.lists(st.integers(3, 380), max_size=4)
stage_max = st.integers(1, 6)
parallel = st.lists(st.tuples(suffix, stage_max), min_size=2, max_size=3)

request = st.fixed_dictionaries({
    "prompt": tokens,
    "shared": st.booleans(),  # starts with the workload's shared prefix
    "loop": st.sampled_from([False, False, True]),  # its own part repeats its first 3 tokens (n-gram hits)
    # None: a plain request; else a fork/join one: (parallel first?, the parallel stage's branches, serial max_tokens)
    "stages": st.none() | st.tuples(st.booleans(), parallel, stage_max),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, MAX_NEW),
    "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    "seed": st.integers(0, 2**31),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.sampled_from(STOP_CANDIDATES), max_size=2, unique=True),
    "stop_str": st.sampled_from([(), (), (), ("and",), (" was",), (":",), ("e",), ("and", ":")]),
    "min_tokens": st.sampled_from([0, 0, 2]),
    # (under the overlap schedule the penalties count the token in flight)
    "presence_penalty": st.sampled_from([0.0, 0.0, 0.0, 0.8]),
    "prompt_logprobs": st.sampled_from([None, None, None, 0]),  # the prompt computed in full; plain requests only
    # a logits processor that reads the output (as a grammar does; such a request never speculates)
    "reads_output": st.sampled_from([False, False, False, True]),
    "speculate": st.sampled_from([True, True, True, False]),  # False: the request opts out of speculation
    "arrive": st.sampled_from([0, 0, 0, 1, 3, 7, 15]),  # the step it is added before
    "abort": st.none() | st.none() | st.integers(0, 30),  # steps after its arrival
})


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


def _stages(r):
    if r["stages"] is None:
        return None
    par_first, branches, serial = r["stages"]
    par = {"branches": [{"prompt": list(s), "max_tokens": m} for s, m in branches]}
    ser = {"max_tokens": serial}
    return [par, ser] if par_first else [ser, par]


def _kv_need(prompt, r):
    """The most KV slots one branch of the request can reach (what the engine
    checks as it enters, `EngineCore.check_stages`)."""
    first = min(r["max_tokens"], 6) if r["stages"] else r["max_tokens"]
    ctx = len(prompt) + first
    need = ctx
    for st_ in _stages(r) or []:
        brs = st_.get("branches") or [{"prompt": [], "max_tokens": st_["max_tokens"]}]
        need = max(need, max(ctx + len(b["prompt"]) + b["max_tokens"] for b in brs))
        ctx += brs[0]["max_tokens"] if len(brs) == 1 else sum(b["max_tokens"] for b in brs)
    return need


def _kv_total(prompt, r):
    """KV slots of the whole request were nothing shared or freed early (a
    rough measure of how much a pool must hold for it to run undisturbed)."""
    if r["stages"] is None:
        return len(prompt) + r["n"] * r["max_tokens"]
    return len(prompt) + min(r["max_tokens"], 6) + sum(
        len(b.get("prompt", [])) + b["max_tokens"] for st_ in _stages(r) for b in st_.get("branches", [st_]))


def _prepare(reqs, head):
    """Each request as (prompt, SamplingParams, stages, arrive, abort)."""
    out = []
    for r in reqs:
        own = (list(r["prompt"][:3]) * 8)[:24] if r["loop"] else list(r["prompt"])
        prompt = (list(head) + own) if r["shared"] else own
        fork = r["stages"] is not None
        greedy = r["temperature"] == 0.0
        max_tokens = min(r["max_tokens"], 6) if fork else r["max_tokens"]
        params = SamplingParams(
            n=1 if fork else r["n"],
            max_tokens=max_tokens,
            temperature=0.0 if greedy else r["temperature"],
            seed=r["seed"],
            ignore_eos=r["ignore_eos"],
            stop_token_ids=list(r["stop"]) or None,
            # stop strings, matched on the detokenized text across token boundaries: pieces of the test
            # tokenizer's vocabulary ("and" is token 265's text, " was" 282's), a character the text often has
            stop=list(r["stop_str"]) or None,
            min_tokens=min(r["min_tokens"], max_tokens),
            presence_penalty=r["presence_penalty"],
            prompt_logprobs=None if fork else r["prompt_logprobs"],
            speculative=r["speculate"],
            logits_processor_factory=NoRepeat() if r["reads_output"] else None,
        )
        out.append((prompt, params, _stages(r), r["arrive"], r["abort"]))
    return out


def _outputs(handle):
    return {o.index: (o.stage, list(o.token_ids), o.finish_reason, o.stop_reason, o.text)
            for o in handle.output(delta=False).outputs}


def _run(engine, prepared, aborts=True):
    """Adds each request at its arrival step, aborts it (if still running) its
    abort steps later; returns {i: (outputs by index, aborted)}."""
    handles, aborted = {}, set()
    abort_step = {i: p[3] + p[4] for i, p in enumerate(prepared) if aborts and p[4] is not None}
    step = 0
    while True:
        for i, (prompt, params, stages, arrive, _) in enumerate(prepared):
            if arrive == step:
                handles[i] = engine.add_request(prompt, params, request_id=f"c{next(_ids)}", stages=stages)
        for i, at in abort_step.items():
            if at == step and handles[i].finished_time is None:
                engine.abort_request(handles[i].request_id)
                aborted.add(i)
        if not engine.has_unfinished() and len(handles) == len(prepared):
            break
        if engine.has_unfinished():
            engine.step()
        step += 1
        assert step < 3000, "the workload did not finish"
    return {i: (_outputs(h), i in aborted) for i, h in handles.items()}


_reference_cache: dict = {}


def _reference(engine, prepared):
    key = _freeze([(p[0], repr(p[1]), repr(p[2])) for p in prepared])
    if key not in _reference_cache:
        plain = [(prompt, params, stages, 0, None) for prompt, params, stages, _, _ in prepared]
        _reference_cache[key] = {i: outs for i, (outs, _) in _run(engine, plain, aborts=False).items()}
    return _reference_cache[key]


def _check(got, expected):
    for i, (outs, was_aborted) in got.items():
        ref = expected[i]
        if not was_aborted:
            assert outs == ref, f"request {i} differs from the reference"
            continue
        for idx, (stage, toks, reason, stop_reason, _) in outs.items():
            r_stage, r_toks, r_reason, r_stop_reason, _ = ref[idx]
            assert stage == r_stage, f"aborted request {i} output {idx}: stage {stage}, reference {r_stage}"
            if reason == "abort":
                assert toks == r_toks[: len(toks)], f"aborted request {i} output {idx} is not a prefix of the reference"
            else:  # finished before the abort
                assert (toks, reason, stop_reason) == (r_toks, r_reason, r_stop_reason), \
                    f"aborted request {i} output {idx} finished otherwise"


def _assert_idle(engine):
    report = engine.kv_report()  # runs the integrity check
    assert not report.busy and report.protected == 0
    assert report.accounted == report.capacity, f"KV leak: {report}"
    assert not engine.core._staged and not engine.requests
    sched = engine.scheduler
    assert not sched.running and not sched.waiting


# -- the configuration ----------------------------------------------------------------

SPECULATIVE = ["none", "ngram", "draft-other", "draft-self"]
SPEC_LENGTHS = ["fixed:1", "fixed:2", "fixed:3", "fixed:4", "adaptive", "adaptive:kmax=4,per_row=0"]
# (branch_policy, slo_tpot_s, slo_ttft_s, with the slow profile)
BRANCH = [
    ("eager", None, None, False), ("off", None, None, False),
    ("cap:1", None, None, False), ("cap:2", None, None, False), ("cap:3", None, None, False),
    # uncalibrated: eager until it has seen 32 steps, then fitted online
    ("taper", 0.05, 1.0, False),
    # every plan priced past the SLO: the baseline rows only
    ("taper:clock=token,late=keep", 0.015, 0.5, True),
    # no profile either, SLOs no step can meet: once fitted online (32 steps) the baseline rows only
    ("taper:clock=token,late=keep,utility=linear,rho=0.5", 1e-4, 1e-3, False),
]


def _config(ckpt, draft, profile, speculative, spec_length, branch, kv_slots, budget, max_running, admission,
            prefix_caching, overlap, gpu_path=False):
    policy, tpot, ttft, slow = branch
    kw = {}
    if speculative != "none":
        kw["speculative"] = "ngram" if speculative == "ngram" else "draft"
        kw["spec_length"] = spec_length
        if speculative.startswith("draft"):
            kw["draft_model"] = draft if speculative == "draft-other" else ckpt
    return EngineConfig(model=ckpt, kv_slots=kv_slots, max_batched_tokens=budget, max_running=max_running,
                        admission=admission, prefix_caching=prefix_caching, branch_policy=policy,
                        slo_tpot_s=tpot, slo_ttft_s=ttft, latency_profile=profile if slow else None,
                        check_invariants=True, overlap_schedule="on" if overlap and speculative == "none" else "off",
                        attention_backend="flashinfer" if gpu_path else "auto", **kw)


def _events(engine, got, expected, speculative, policy, processors):
    """What the example exercised (`--hypothesis-show-statistics`)."""
    st_ = engine.stats()
    pol = st_.policy
    yes = {True: "yes", False: "no"}
    event(f"retractions: {yes[bool(st_.retractions)]}")
    if st_.retractions and speculative != "none":
        event("retractions while speculating")
    event(f"prefix hits: {yes[bool(st_.prefix_hit_tokens)]}")
    if "spec_draft_tokens" in pol:
        event(f"{speculative}: drafts accepted: {yes[bool(pol.get('spec_accepted_tokens'))]}")
    if "branch_rows_deferred" in pol:
        event(f"{policy}: rows deferred: {yes[bool(pol['branch_rows_deferred'])]}")
    event(f"aborted requests: {sum(a for _, a in got.values())}")
    if any(a and len(outs) < len(expected[i]) and len(expected[i]) > 1 for i, (outs, a) in got.items()):
        event("a request aborted before its last stage or branch")
    reasons = {o[2] for outs, _ in got.values() for o in outs.values()}
    event(f"stop finish: {yes['stop' in reasons]}")
    if engine.overlap_schedule:
        event(f"overlap schedule, a processor that reads the output: {yes[processors]}")
    event(f"the GPU path's backend (fake flashinfer): {yes[engine.attention_backend == 'FlashInferAttention']}")


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(
    reqs=st.lists(request, min_size=1, max_size=6),
    head=st.lists(st.integers(3, 380), min_size=1, max_size=24),
    speculative=st.sampled_from(SPECULATIVE),
    spec_length=st.sampled_from(SPEC_LENGTHS),
    branch=st.sampled_from(BRANCH),
    # the KV pool: the largest request's need plus a slack, or a share of the whole workload's, if more
    kv_slack=st.sampled_from([0, 1, 3, 8, 20, 200]),
    kv_share=st.sampled_from([0.0, 0.0, 0.3, 0.5, 0.9]),
    # the scheduler's new-token ratio (admission's reserve for running sequences' future tokens): 0.7 when
    # an engine starts, decaying to 0.1 over ~600 calm steps; a low one admits more, and retracts more
    token_ratio=st.sampled_from([None, 0.3, 0.1]),
    budget=st.integers(2, 64),
    max_running=st.integers(1, 8),
    admission=st.sampled_from(["fcfs", "lpm"]),
    prefix_caching=st.booleans(),
    again=st.booleans(),  # then the same workload once more, on the warm engine
    overlap=st.booleans(),  # the overlap schedule (without speculation)
    gpu_path=st.sampled_from([False, False, False, True]),  # flashinfer's backend, its stand-in on the CPU
)
def test_features_compose_to_the_reference_tokens(llama_ckpt, draft_ckpt, slow_profile, reference_engine, reqs,
                                                  head, speculative, spec_length, branch, kv_slack, kv_share,
                                                  token_ratio, budget, max_running, admission, prefix_caching, again,
                                                  overlap, gpu_path):
    prepared = _prepare(reqs, head)
    kv_slots = max(max(_kv_need(p[0], r) for p, r in zip(prepared, reqs)) + kv_slack,
                   int(kv_share * sum(_kv_total(p[0], r) for p, r in zip(prepared, reqs))))
    expected = _reference(reference_engine, prepared)
    config = _config(llama_ckpt, draft_ckpt, slow_profile, speculative, spec_length, branch, kv_slots, budget,
                     max_running, admission, prefix_caching, overlap, gpu_path)
    # (readable on failure: this hypothesis prints the falsifying arguments' values empty)
    note(f"config: {config}\nnew_token_ratio: {token_ratio}, again: {again}")
    for i, p in enumerate(prepared):
        note(f"request {i}: prompt={p[0]} params={p[1]} stages={p[2]} arrive={p[3]} abort={p[4]}")
    with mock.patch.dict(sys.modules, {"flashinfer": fake_flashinfer}):  # (only a gpu_path engine imports it)
        engine = Engine(config)
    if token_ratio is not None:
        engine.scheduler.new_token_ratio = token_ratio
    got = _run(engine, prepared)
    _check(got, expected)
    _assert_idle(engine)
    if again:
        got2 = _run(engine, prepared)
        _check(got2, expected)
        _assert_idle(engine)
    _events(engine, got, expected, speculative, branch[0], any(r["reads_output"] for r in reqs))


def test_lpm_admission_with_prompt_logprobs(llama_ckpt):
    """LPM admission ranks the waiting queue by cached prefix; a request that
    wants prompt logprobs bypasses the cache, and must still be admitted (its
    missing match crashed the step: found by the property above)."""
    engine = Engine(EngineConfig(model=llama_ckpt, admission="lpm", check_invariants=True))
    req = engine.add_request([10, 11, 12], SamplingParams(max_tokens=2, prompt_logprobs=0, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert len(req.output(delta=False).outputs[0].token_ids) == 2
    _assert_idle(engine)


def test_stop_token_that_completes_a_stop_string(llama_ckpt, reference_engine):
    """Token 265's text is "and": with stop_token_ids=[265] and stop=["and"]
    the branch ends at it either way, and ends alike with speculation (the
    target as its own draft: the token comes inside an accepted run): the stop
    string decides the stop reason and cuts the text. Plain decoding used to
    let the stop token win (found by the property above)."""
    prompt = [51, 319, 131, 275, 364, 311, 78, 161]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    h = reference_engine.add_request(prompt, greedy)
    while reference_engine.has_unfinished():
        reference_engine.step()
    # (the llama test checkpoint's greedy output; were it to change, pick another prompt)
    assert 265 in _outputs(h)[0][1][2:]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[265], stop=["and"])
    spec = Engine(EngineConfig(model=llama_ckpt, speculative="draft", draft_model=llama_ckpt, spec_length="fixed:4",
                               check_invariants=True))
    got = {}
    for name, engine in (("plain", reference_engine), ("speculative", spec)):
        h = engine.add_request(prompt, sp)
        while engine.has_unfinished():
            engine.step()
        got[name] = _outputs(h)[0]
    assert got["speculative"] == got["plain"]
    _, toks, finish, reason, text = got["plain"]
    assert (finish, reason, toks[-1]) == ("stop", "and", 265) and not text.endswith("and")
