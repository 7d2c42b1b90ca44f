"""`AsyncEngine` on a thread and in its own process: the same streams as the
offline engine, errors back to the caller, aborts that free KV, calls, pause,
merged deltas for slow consumers, and a dead engine process failing loudly."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest

from stepserve import LLM, AsyncEngine, SamplingParams
from stepserve.engine.async_engine import EngineDeadError
from stepserve.engine.request import CompletionOutput, RequestMetrics, RequestOutput


_stalled = itertools.count()


async def collect(engine, prompt, params, request_id: str | None = None, stall: bool = False):
    """(text, tokens, finish reasons, number of deltas) of one request.
    `stall`: after the first delta, read nothing more until the engine has
    finished the request (every later delta queues up meanwhile)."""
    text, toks, reasons, deltas = "", [], [], 0
    rid = request_id or (f"stalled-{next(_stalled)}" if stall else None)
    async for out in engine.generate(prompt, params, rid):
        deltas += 1
        for o in out.outputs:
            text += o.text
            toks += o.token_ids
            if o.finish_reason:
                reasons.append(o.finish_reason)
        if stall and deltas == 1:
            while await asyncio.wrap_future(engine.call(_unfinished, rid)):
                await asyncio.sleep(0.01)
    return text, toks, reasons, deltas


def engine_report(engine: AsyncEngine):
    return asyncio.run(asyncio.wait_for(engine.kv_report(), 30))


def assert_clean(engine: AsyncEngine):
    r = engine_report(engine)
    assert not r.busy and r.protected == 0 and r.accounted == r.capacity


def _count_requests(engine, extra):
    return len(engine.requests) + extra


@pytest.fixture(scope="module", params=[False, True], ids=["thread", "process"])
def aengine(request, llama_ckpt):
    engine = AsyncEngine(model=llama_ckpt, check_invariants=True, process=request.param)
    yield engine
    engine.shutdown()


def test_stream_equals_offline_and_abort_frees_kv(aengine, llama_ckpt):
    params = SamplingParams(max_tokens=25, temperature=1.0, seed=11, ignore_eos=True, stop=["zz"])

    async def abort_midway():
        n = 0
        async for out in aengine.generate("abort me", SamplingParams(max_tokens=400, ignore_eos=True)):
            n += len(out.outputs[0].token_ids) if out.outputs else 0
            if n >= 3:
                break  # leaving the iterator aborts the request
        return n

    async def main():
        res = await asyncio.gather(collect(aengine, "In the beginning", params), abort_midway(),
                                   *[collect(aengine, f"prompt {i}", SamplingParams(max_tokens=5, ignore_eos=True))
                                     for i in range(6)])
        with pytest.raises(ValueError, match="empty"):  # the engine's own check, raised in the caller
            async for _ in aengine.generate([], SamplingParams()):
                pass
        return res

    res = asyncio.run(main())
    text, toks, reasons, _ = res[0]
    assert reasons == ["length"] and len(toks) == 25
    assert all(r[2] == ["length"] and len(r[1]) == 5 for r in res[2:])
    offline = LLM(llama_ckpt).generate(["In the beginning"], params)[0].outputs[0]
    assert toks == offline.token_ids and text == offline.text
    assert_clean(aengine)


def test_slow_consumer_gets_merged_deltas_with_the_same_text(aengine, llama_ckpt):
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=5, ignore_eos=True, logprobs=2)
    fast = asyncio.run(collect(aengine, "And God said", params))
    slow = asyncio.run(collect(aengine, "And God said", params, stall=True))
    assert slow[:3] == fast[:3] and len(slow[1]) == 40
    assert slow[3] == 2  # the first delta, then everything that queued up, merged into one


def _frozen_objects(engine):
    import gc

    return gc.get_freeze_count()


def test_engine_process_freezes_its_startup_heap(aengine):
    """An engine in a process of its own takes its start-up objects (torch,
    transformers, the model) out of the cyclic collector's reach once it is
    loaded: a full collection walks every tracked object, a ~95 ms stall of
    every stream with the engine loaded. An engine thread in the caller's
    process leaves the caller's heap as it is: there an engine dropped after
    a freeze would never be collected."""
    import gc

    frozen = aengine.call(_frozen_objects).result(timeout=30)
    if aengine.engine is None:  # its own process
        assert frozen > 50_000
    else:  # a thread of this process: untouched
        assert frozen == gc.get_freeze_count() == 0


def test_call_pause_resume_and_bad_calls(aengine):
    assert engine_report(aengine).capacity == aengine.info.kv_capacity
    assert aengine.call(_count_requests, 2).result(timeout=30) == 2
    # a lambda does not pickle into a process; a raising function raises in the caller; the loop lives on
    with pytest.raises(Exception):
        aengine.call(lambda e: 1 / 0).result(timeout=30)
    assert aengine.is_alive()

    async def paused():
        aengine.pause()
        task = asyncio.ensure_future(collect(aengine, "held", SamplingParams(max_tokens=4, ignore_eos=True)))
        await asyncio.sleep(0.5)
        assert not task.done()  # added but not stepped
        stats = await aengine.stats()
        assert stats.waiting + stats.running == 1
        aengine.resume()
        return await task

    assert asyncio.run(paused())[2] == ["length"]
    assert_clean(aengine)


def test_request_output_merge_joins_per_choice():
    m = RequestMetrics(0.0)
    a = RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [1, 2]), CompletionOutput(1, "x", [7])], False, 0, m)
    b = RequestOutput("r", None, [1], [CompletionOutput(1, "y", [8], finish_reason="length"),
                                       CompletionOutput(2, "q", [9])], True, 1, m)
    a.merge(b)
    assert [(o.index, o.text, o.token_ids, o.finish_reason) for o in a.outputs] == [
        (0, "ab", [1, 2], None), (1, "xy", [7, 8], "length"), (2, "q", [9], None)]
    assert a.finished and a.num_cached_tokens == 1


def _unfinished(engine, rid):
    return rid in engine.requests


def test_engine_process_death_fails_waiters_and_new_requests(llama_ckpt):
    """Killed while a request is provably unfinished (the engine is paused,
    and a call that queued behind the add says the request is there), the
    waiter gets EngineDeadError, so do later requests and calls, and the
    death callbacks run once."""
    from stepserve.engine.async_engine import EngineDeadError

    engine = AsyncEngine(model=llama_ckpt, process=True)
    deaths = []
    engine.on_death(deaths.append)
    try:
        async def main():
            first = await collect(engine, "warm", SamplingParams(max_tokens=2, ignore_eos=True))
            assert first[2] == ["length"]
            engine.pause()
            task = asyncio.ensure_future(collect(engine, "doomed", SamplingParams(max_tokens=20, ignore_eos=True),
                                                 request_id="doomed"))
            await asyncio.sleep(0)  # let it submit
            assert await asyncio.wrap_future(engine.call(_unfinished, "doomed"))
            os.kill(engine._core._proc.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="SIGKILL"):
                await asyncio.wait_for(task, 30)
            with pytest.raises(EngineDeadError, match="engine loop died"):
                async for _ in engine.generate("after", SamplingParams(max_tokens=2)):
                    pass

        asyncio.run(main())
        assert not engine.is_alive()
        assert len(deaths) == 1 and "SIGKILL" in str(deaths[0])
        assert engine._core._proc.exitcode == -signal.SIGKILL  # reaped: no <defunct> child
        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(engine.kv_report(), 5))
        late = []
        engine.on_death(late.append)  # registered after the death: called at once
        assert len(late) == 1
    finally:
        engine.shutdown()
    assert len(deaths) == 1  # a shutdown is no second death


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_shutdown_is_not_a_death(llama_ckpt, process):
    """Shut down, the engine is not dead to its death callbacks, but a
    request still running, and any asked for after, fail with
    EngineDeadError rather than wait forever (on a thread too)."""
    engine = AsyncEngine(model=llama_ckpt, process=process)
    deaths = []
    engine.on_death(deaths.append)

    async def run():
        agen = engine.generate("more", SamplingParams(max_tokens=400, ignore_eos=True))
        await agen.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate("hi", SamplingParams(max_tokens=2)):
                pass
        with pytest.raises(EngineDeadError):
            await engine.stats()

    asyncio.run(asyncio.wait_for(run(), 60))
    engine.shutdown()  # twice is fine
    assert deaths == [] and not engine.is_alive()


SCRIPT = """
import asyncio, sys
from stepserve import AsyncEngine, SamplingParams

async def main(model):
    if sys.argv[2] == "async-with":
        async with AsyncEngine(model=model, process=True) as engine:
            async for _ in engine.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True)):
                pass
        assert not engine.is_alive()
    else:  # never shut down: the exit hook must stop the engine process
        engine = AsyncEngine(model=model, process=True)
        async for _ in engine.generate("hi", SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
        if sys.argv[2] == "mid-request":  # and leave one running
            agen = engine.generate("more", SamplingParams(max_tokens=400, ignore_eos=True))
            await agen.__anext__()
    print("child pid", engine._core._proc.pid, flush=True)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.parametrize("mode", ["no-shutdown", "mid-request", "async-with"])
def test_a_script_exits_by_itself(llama_ckpt, tmp_path, mode):
    """A script that never calls shutdown() exits (before, the engine process
    ignored multiprocessing's SIGTERM and the interpreter waited forever), and
    leaves no engine process behind; `async with` stops it too."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    r = subprocess.run([sys.executable, str(script), llama_ckpt, mode], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split("child pid")[1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_engine_process_start_failure_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start"):
        AsyncEngine(model=str(tmp_path), process=True)  # no config.json there


def test_engine_process_refuses_a_config_that_does_not_pickle(llama_ckpt):
    from stepserve.engine.engine import EngineConfig

    class LocalPolicy:  # defined in a function: cannot be pickled by reference
        def plan(self, plan, view):
            return plan

        def observe(self, plan, record):
            pass

    with pytest.raises(ValueError, match="process=False"):
        AsyncEngine(EngineConfig(model=llama_ckpt, policies=[LocalPolicy()]), process=True)


def test_params_that_do_not_pickle_fail_only_their_request(aengine):
    """A closure as logits processor works on a thread; sent to an engine
    process it cannot travel, and only that request fails."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, logits_processor_factory=lambda: (lambda ids, row: None))

    async def main():
        if aengine.engine is not None:  # thread: the closure runs in place
            return (await collect(aengine, "closure", params))[2]
        with pytest.raises(ValueError, match="cannot send"):
            await collect(aengine, "closure", params)
        return (await collect(aengine, "plain", SamplingParams(max_tokens=3, ignore_eos=True)))[2]

    assert asyncio.run(main()) == ["length"]
    assert_clean(aengine)


def _tokenize(engine, text):
    return engine.tokenize(text)


def test_every_delta_carries_its_prompt(aengine):
    """A text prompt or token ids, on both transports: every delta has the
    prompt as given and its ids (from an engine process, a text prompt's ids
    cross the pipe once, token ids never)."""
    ids = aengine.call(_tokenize, "In the beginning").result(timeout=30)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def prompts_of(prompt):
        return [(out.prompt, out.prompt_token_ids) async for out in aengine.generate(prompt, params)]

    async def main():
        return await asyncio.gather(prompts_of("In the beginning"), prompts_of(tuple(ids)))

    text, token_ids = asyncio.run(main())
    assert ids and text and all(p == ("In the beginning", ids) for p in text)
    assert token_ids and all(p == (None, ids) for p in token_ids)  # a list, as the engine makes it


def _unpicklable_result(engine):
    import threading

    return threading.Lock()


def test_a_call_result_that_does_not_pickle_fails_only_that_call(aengine):
    fut = aengine.call(_unpicklable_result)
    if aengine.engine is not None:  # thread: nothing to pickle
        assert fut.result(timeout=30) is not None
    else:
        with pytest.raises(RuntimeError, match="does not pickle"):
            fut.result(timeout=30)
    assert aengine.call(_count_requests, 2).result(timeout=30) >= 2 and aengine.is_alive()  # the loop lives on


def test_wire_format_round_trips_every_field():
    """What crosses the engine-process pipe rebuilds the same outputs. Every
    field is set here by name, so a field added to the dataclasses fails here
    until it is set below and `OutputBatch` carries it; the prompt never
    travels back, and its ids only once, for a text prompt."""
    import dataclasses
    import pickle

    from stepserve.engine.async_engine import CallReply
    from stepserve.engine.engine_process import OutputBatch, decode_batch, encode_batch
    from stepserve.engine.request import TokenLogprob

    def names(cls):
        return {f.name for f in dataclasses.fields(cls)}

    def build(cls, **values):
        assert set(values) == names(cls), f"set every {cls.__name__} field in this test, and carry it on the wire"
        return cls(**values)

    columns = set(OutputBatch._fields)
    assert names(CompletionOutput) | names(RequestMetrics) <= columns
    assert names(RequestOutput) - {"prompt", "outputs", "metrics"} <= columns  # the parent has the prompt

    def output(rid, prompt, ids, finished, **completion):
        comp = dict(index=1, text="x", token_ids=[7], finish_reason=None, stop_reason=None,
                    logprobs=[TokenLogprob(7, -0.5, [(7, -0.5), (3, -2.0)])], cumulative_logprob=-0.5,
                    stage=0, error=None) | completion
        return build(RequestOutput, request_id=rid, prompt=prompt, prompt_token_ids=ids,
                     outputs=[build(CompletionOutput, **comp),
                              build(CompletionOutput, **(comp | {"index": 2, "stage": 1}))],
                     finished=finished, num_cached_tokens=1,
                     metrics=build(RequestMetrics, arrival_time=1.0, first_token_time=2.0, finished_time=3.0,
                                   first_scheduled_time=1.5),
                     prompt_logprobs=[None, TokenLogprob(6, -1.0, [])])

    text_first = output("r-text", "hi", [5, 6], False)
    text_last = output("r-text", "hi", [5, 6], True, finish_reason="stop", stop_reason="zz")
    ids_only = output("r-ids", None, [8, 9], True, finish_reason="abort", error="lexer error: too many expressions")
    bad = ValueError("prompt too long")
    sent = {"r-text": "hi", "r-ids": (8, 9), "r-bad": "no"}  # as the front end sent them (ids: any sequence)
    prompts = dict(sent)  # the parent's
    owed = {rid for rid, p in sent.items() if isinstance(p, str)}  # the child's: text prompts

    def across(batch):
        outputs, replies = decode_batch(pickle.loads(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL)), prompts)
        errors_as_text = [(rid, repr(x) if isinstance(x, BaseException) else x) for rid, x in outputs]
        return errors_as_text, replies

    first = encode_batch([("r-text", text_first), ("r-bad", bad), ("r-ids", ids_only)], [CallReply(3, True, 4)], owed)
    assert first.prompt_token_ids == {0: [5, 6]} and not owed  # the ids of the text prompt only
    assert across(first) == ([("r-text", text_first), ("r-bad", repr(bad)), ("r-ids", ids_only)],
                             [CallReply(3, True, 4)])  # in the loop's order
    last = encode_batch([("r-text", text_last)], [], owed)
    assert last.prompt_token_ids == {}  # sent once
    assert across(last) == ([("r-text", text_last)], [])
    assert prompts == {}  # finished and failed requests are forgotten


def _tokenize_calls(engine) -> int:
    """How often the engine has tokenized a text since this was first called
    (run on the loop: in the engine's own process too)."""
    if not hasattr(engine, "_tokenize_calls"):
        real = engine.tokenize

        def counted(text):
            engine._tokenize_calls += 1
            return real(text)

        engine._tokenize_calls = 0
        engine.tokenize = counted
    return engine._tokenize_calls


@pytest.mark.parametrize("inline", [True, False], ids=["short", "long"])
def test_text_is_tokenized_by_the_caller_not_on_the_loop(aengine, llama_ckpt, monkeypatch, inline):
    """A text prompt and the text suffixes of a fork/join request's branches
    reach the engine as token ids, tokenized on the caller's side (a long text
    in a worker thread): tokenized on the loop, a megabyte of text stalled
    every request in flight. The outputs, and the prompt every delta carries,
    are those of the same text given to the offline engine; the caller's
    stage dicts are left as given."""
    import stepserve.engine.async_engine as ae

    if not inline:  # every text takes the worker-thread path
        monkeypatch.setattr(ae, "INLINE_TOKENIZE_CHARS", 0)
    before = aengine.call(_tokenize_calls).result(timeout=30)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    stages = [{"branches": [{"prompt": " and the", "max_tokens": 3}, {"prompt": [5, 6], "max_tokens": 2}]},
              {"max_tokens": 2}]
    given = [dict(st, branches=[dict(b) for b in st["branches"]]) if "branches" in st else dict(st) for st in stages]

    async def run():
        outs = [out async for out in aengine.generate("In the beginning", params, stages=stages)]
        return outs

    outs = asyncio.run(run())
    assert aengine.call(_tokenize_calls).result(timeout=30) == before
    assert stages == given
    ids = LLM(llama_ckpt).engine.tokenize("In the beginning")
    assert all((o.prompt, o.prompt_token_ids) == ("In the beginning", ids) for o in outs)
    got: dict[int, list[int]] = {}
    for o in outs:
        for c in o.outputs:
            got.setdefault(c.index, []).extend(c.token_ids)
    offline = LLM(llama_ckpt).generate(["In the beginning"], params, stages=stages)[0].outputs
    assert got == {c.index: c.token_ids for c in offline}
    assert_clean(aengine)
