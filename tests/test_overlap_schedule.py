"""The overlap schedule (`EngineCore._step_overlap`): step N+1 is scheduled
and launched before step N's tokens are applied. On the CPU nothing runs
concurrently, but every piece of bookkeeping it needs runs as it does on a
GPU -- placeholders read on the device, rows of sequences that step N ended
dropped from step N+1 with their slots freed, the steps that must wait --
so its tokens, texts, logprobs and KV accounting are checked here against
the plain schedule. (The random composition test in
test_composition_property.py draws it too.)"""

from __future__ import annotations

import sys

import pytest
import torch

import fake_flashinfer
from processors import NoRepeat
from stepserve import LLM, SamplingParams
from stepserve.engine.engine import Engine, EngineConfig


def prompts_of(lengths, seed=0, vocab=380):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _outputs(results):
    return [[(o.token_ids, o.text, o.finish_reason, o.stop_reason,
              None if o.logprobs is None else [(t.token_id, round(t.logprob, 4)) for t in o.logprobs])
             for o in r.outputs] for r in results]


def _workload(prompts, stop_token):
    """Greedy, seeded sampling with n > 1 and logprobs, a stop token met
    mid-run, a stop string, min_tokens, penalties (counted on the device,
    the token in flight too), prompt logprobs."""
    kinds = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.9, seed=11, n=3, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["e"], min_tokens=2),
        SamplingParams(max_tokens=20, temperature=0.7, seed=5, presence_penalty=0.8, frequency_penalty=0.3,
                       repetition_penalty=1.3),
        SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=1),
    ]
    return prompts, [kinds[i % len(kinds)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("llama")


def _stop_token(llm, prompt):
    """A token that greedy decoding of `prompt` meets after a few steps."""
    toks = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].token_ids
    return toks[4]


@pytest.mark.parametrize("kv_slots", [None, 160])
def test_overlap_equals_plain_schedule(ckpt, kv_slots):
    """Same outputs, with a KV pool roomy or tight enough that steps must
    wait before retracting; the KV integrity check after every step, and the
    pool whole at the end."""
    prompts = prompts_of([9 + 5 * i for i in range(12)], seed=3)
    plain = LLM(ckpt, overlap_schedule="off", kv_slots=kv_slots, check_invariants=True, device="cpu")
    ps, params = _workload(prompts, _stop_token(plain, prompts[2]))
    ov = LLM(ckpt, overlap_schedule="on", kv_slots=kv_slots, check_invariants=True, device="cpu")
    for llm in (plain, ov):  # admission's reserve for running sequences low: it admits more, then retracts
        llm.engine.scheduler.new_token_ratio = 0.05
    want = _outputs(plain.generate(ps, params))
    got = _outputs(ov.generate(ps, params))
    assert got == want
    eng = ov.engine
    assert eng.overlap_schedule and eng.core.overlapped_steps > 10
    if kv_slots is not None:
        assert eng.stats().retractions > 0
    report = eng.kv_report()
    assert not report.busy and report.accounted == report.capacity


def test_penalties_count_the_token_in_flight(ckpt):
    """Penalties read every output token, the last one still on the device
    when the next step is launched: the counts resolve it there, so these
    requests do not make the schedule wait (every decode step overlapped),
    and their tokens equal the plain schedule's. Strong penalties over a
    small vocabulary: a token missed in the counts changes what is sampled."""
    prompts = prompts_of([7, 11, 16, 9], seed=12)
    params = [SamplingParams(max_tokens=40, temperature=t, seed=3 + i, ignore_eos=True, **pen)
              for i, (t, pen) in enumerate([
                  (0.0, dict(frequency_penalty=2.0)),
                  (0.8, dict(presence_penalty=1.5)),
                  (0.0, dict(repetition_penalty=1.8)),
                  (1.0, dict(frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.2)),
              ])]
    want = _outputs(LLM(ckpt, overlap_schedule="off", device="cpu").generate(prompts, params))
    ov = LLM(ckpt, overlap_schedule="on", device="cpu", check_invariants=True)
    assert _outputs(ov.generate(prompts, params)) == want
    # without penalties, greedy decoding repeats itself; with them it may not: they took effect
    bare = _outputs(ov.generate(prompts, [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 4))
    assert bare[0][0][0] != want[0][0][0] and bare[2][0][0] != want[2][0][0]
    # every step but the first (the prompts' prefill, nothing in flight) and the last ones' was overlapped
    core = ov.engine.core
    assert core.overlapped_steps >= 2 * 39 - 2


def test_processors_that_read_the_output_keep_the_overlap(ckpt):
    """A row whose logits processor reads its output (a grammar) is sampled
    once the step before is finished, after this step's forward pass was
    launched: its processor sees every token, none a placeholder, and the
    steps stay overlapped. A processor that says it reads no output
    (`AllowedTokens`) is sampled at once. Tokens equal the plain schedule's."""
    from stepserve.engine.grammar import AllowedTokens

    prompts = prompts_of([6, 13, 9, 17, 11], seed=21)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logits_processor_factory=NoRepeat()),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, seed=4, logits_processor_factory=NoRepeat()),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             logits_processor_factory=AllowedTokens(tuple(range(40, 60)))),
              SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
                             logits_processor_factory=NoRepeat())]
    want = _outputs(LLM(ckpt, overlap_schedule="off", device="cpu").generate(prompts, params))
    # the processors took effect: no token repeats its predecessor; the allowed ones only
    assert all(a != b for a, b in zip(want[0][0][0], want[0][0][0][1:]))
    assert set(want[3][0][0]) <= set(range(40, 60))
    ov = LLM(ckpt, overlap_schedule="on", device="cpu", check_invariants=True)
    assert _outputs(ov.generate(prompts, params)) == want
    core = ov.engine.core
    assert core.overlapped_steps >= 29 - 2  # every step but the first and the last


def test_overlap_with_decode_graphs(monkeypatch, ckpt):
    """The flashinfer backend and the decode-graph runner's static buffers
    (through the CPU stand-in for flashinfer): a step's placeholders are
    filled in the graph's input buffer from the step before."""
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    prompts = prompts_of([5 + 7 * i for i in range(7)], seed=4)
    lens = [4 + 3 * i for i in range(7)]
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in lens]
    kw = dict(attention_backend="flashinfer", max_running=16, device="cpu", check_invariants=True)
    want = _outputs(LLM(ckpt, overlap_schedule="off", **kw).generate(prompts, params))
    ov = LLM(ckpt, overlap_schedule="on", **kw)
    assert _outputs(ov.generate(prompts, params)) == want
    assert ov.engine.runner.graphs.replays > 10 and ov.engine.core.overlapped_steps > 10


def test_stop_token_frees_the_row_already_launched(ckpt):
    """A sequence that stops on a token has a row in the step launched
    meanwhile: that row's token is dropped (the output ends at the stop
    token) and its slot freed at once (the per-step integrity check would
    find it leaked)."""
    prompts = prompts_of([20, 14], seed=6)
    plain = LLM(ckpt, overlap_schedule="off", device="cpu")
    stop = _stop_token(plain, prompts[0])
    params = [SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)]
    want = _outputs(plain.generate(prompts, params))
    assert want[0][0][2] == "stop" and want[0][0][0][-1] == stop
    eng = Engine(EngineConfig(model=ckpt, overlap_schedule="on", check_invariants=True, device="cpu"))
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    used_after_stop = None
    while eng.has_unfinished():
        eng.step()
        if reqs[0].finished and used_after_stop is None:
            # what is held is the other sequence's alone: its computed tokens and its in-flight one
            b = reqs[1].seqs[0]
            report = eng.kv_report()
            used_after_stop = report.capacity - report.accounted
            assert used_after_stop == b.num_computed - b.num_cached
    assert _outputs([r.output(delta=False) for r in reqs]) == want


def test_streams_and_aborts_never_show_a_placeholder(ckpt):
    """Between steps a running sequence's last token may still be on the
    device: deltas never carry it (nor a negative id), and an abort drops it."""
    eng = Engine(EngineConfig(model=ckpt, overlap_schedule="on", check_invariants=True, device="cpu"))
    prompts = prompts_of([12, 17, 9], seed=8)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for p in prompts]
    streamed = [[] for _ in reqs]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 6:
            eng.abort_request(reqs[1].request_id)
        for i, r in enumerate(reqs):
            for o in r.output(delta=True).outputs:
                assert all(t >= 0 for t in o.token_ids)
                streamed[i].extend(o.token_ids)
    for i, r in enumerate(reqs):
        final = r.output(delta=False).outputs[0]
        assert streamed[i] == final.token_ids and all(t >= 0 for t in final.token_ids)
    assert reqs[1].output(delta=False).outputs[0].finish_reason == "abort"
    assert len(reqs[0].output(delta=False).outputs[0].token_ids) == 20
    report = eng.kv_report()
    assert not report.busy and report.accounted == report.capacity


def test_overlap_schedule_settings(ckpt):
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(model=ckpt, overlap_schedule="on", speculative="ngram")
    with pytest.raises(ValueError, match="overlap_schedule"):
        EngineConfig(model=ckpt, overlap_schedule="yes")
    # auto: on CUDA only (on the CPU the host is the device), and never with speculation
    assert Engine(EngineConfig(model=ckpt, device="cpu")).overlap_schedule is False
    if torch.cuda.is_available():
        assert Engine(EngineConfig(model=ckpt, device="cuda", attention_backend="torch")).overlap_schedule is True
