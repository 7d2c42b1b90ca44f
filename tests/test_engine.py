"""Engine behaviour through the Python API: seeds, branches, stops, logprobs,
text, streaming, aborts, validation."""


import pytest
import torch

from stepserve import LLM, SamplingParams
from stepserve.engine.engine import EngineConfig
from stepserve.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(llama_ckpt, check_invariants=True)


def ids(llm, text):
    return llm.tokenizer.encode(text, add_special_tokens=False)


def assert_idle(engine):
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.kv.tree.protected_size() == 0
    engine.check()
    kv = sched.kv
    assert kv.allocator.available() + kv.tree.total_size() == kv.capacity


def test_seed_gives_same_tokens_whatever_else_is_in_the_batch(llm):
    p = SamplingParams(max_tokens=20, temperature=1.3, seed=1234, ignore_eos=True)
    alone = llm.generate(["In the beginning"], p)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8, top_k=5, ignore_eos=True) for n in (3, 30, 11)]
    mixed = llm.generate(["The quick brown fox", "In the beginning", "def main", "x"],
                         [others[0], p, others[1], others[2]])
    assert mixed[1].outputs[0].token_ids == alone
    # and a different seed changes them
    q = SamplingParams(max_tokens=20, temperature=1.3, seed=99, ignore_eos=True)
    assert llm.generate(["In the beginning"], q)[0].outputs[0].token_ids != alone
    assert_idle(llm.engine)


def test_temperature_zero_is_greedy(llm):
    g = llm.generate(["darkness was upon"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    k1 = llm.generate(["darkness was upon"], SamplingParams(max_tokens=12, top_k=1, seed=5, ignore_eos=True))
    assert g[0].outputs[0].token_ids == k1[0].outputs[0].token_ids


def test_n_branches_share_the_prompt_kv(llm):
    eng = llm.engine
    prompt = "And the earth was without form, and void"
    plen = len(ids(llm, prompt))
    start = eng.step_id
    p = SamplingParams(n=4, max_tokens=10, temperature=2.0, seed=7, ignore_eos=True)
    before = len(eng.records)
    out = llm.generate([prompt], p)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    seqs = [tuple(o.token_ids) for o in out.outputs]
    assert len(set(seqs)) > 1, "seeded branches must differ"
    assert all(len(s) == 10 for s in seqs)
    # the prompt was computed once; each branch then computed its own 9 tokens
    computed = sum(r.new_tokens for r in eng.records[before:])
    assert computed == plen + 4 * 9, (computed, plen)
    again = llm.generate([prompt], p)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == seqs
    assert eng.step_id > start
    assert_idle(eng)


def test_n_branches_of_many_requests_wait_for_rows_and_too_many_are_refused(llama_ckpt, llm):
    """Each n > 1 request is admitted only while rows remain for its siblings
    *and* for those of the requests admitted before it that have not forked
    yet: four prompts with n = 5 under max_running 4 (16 rows) cannot all fork
    at once (20 rows), so some wait, and every branch gets the tokens it gets
    alone. An n larger than the rows the engine keeps could never run (it
    would block the queue behind it): it is refused at entry, naming n."""
    small = LLM(llama_ckpt, max_running=4, check_invariants=True)
    eng = small.engine
    prompts = ["In the beginning", "And God said", "darkness was upon", "the waters"]
    params = [SamplingParams(n=5, max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True) for i in range(4)]
    got = small.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, got):
        alone = llm.generate([prompt], p)[0]
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in alone.outputs]
    assert max(r.rows for r in eng.records) <= eng.req_pool.max_rows
    assert_idle(eng)
    rows = eng.req_pool.max_rows
    with pytest.raises(ValueError, match=r"^n \(17\)") as e:
        small.generate(["hi"], SamplingParams(n=rows + 1, max_tokens=2))
    assert e.value.param == "n" and not eng.requests and not eng.scheduler.waiting
    out = small.generate(["hi"], SamplingParams(n=rows, max_tokens=2, seed=1, ignore_eos=True))[0]
    assert len(out.outputs) == rows
    assert_idle(eng)


def _clean_boundary(llm, toks):
    """Index i where tokens i and i+1 decode to clean text on their own."""
    dec = llm.tokenizer.decode
    for k in range(2, len(toks) - 1):
        a, b = dec([toks[k]]), dec([toks[k + 1]])
        whole = dec(toks[: k + 2])
        if len(a) >= 2 and b and "\ufffd" not in whole and whole.endswith(a + b):
            return k, a, b
    return None


def test_stop_string_spanning_tokens(llm):
    for seed in range(20):
        p = SamplingParams(max_tokens=30, temperature=1.0, seed=seed, ignore_eos=True)
        full = llm.generate(["In the beginning God"], p)[0].outputs[0]
        found = _clean_boundary(llm, full.token_ids)
        if found:
            break
    i, a, b = found
    stop = a[-2:] + b[:1]  # the end of token i and the start of token i+1
    upto = llm.tokenizer.decode(full.token_ids[: i + 2])
    cut = upto.find(stop)
    p.stop = [stop]
    out = llm.generate(["In the beginning God"], p)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) <= i + 2
    p.include_stop_str_in_output = True
    keep = llm.generate(["In the beginning God"], p)[0].outputs[0]
    assert keep.text == full.text[:cut] + stop


def test_stop_token_ids_and_eos(llm):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    toks = llm.generate(["heaven"], p)[0].outputs[0].token_ids
    stop_tok = toks[3]
    first = toks.index(stop_tok)
    out = llm.generate(["heaven"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == toks[: first + 1] and o.stop_reason == stop_tok
    # the stop token's text is not output (as vLLM), unless include_stop_str_in_output; streamed the same
    dec = llm.tokenizer.decode
    assert dec([stop_tok]).strip() and o.text == dec(toks[:first])
    keep = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok], include_stop_str_in_output=True)
    assert llm.generate(["heaven"], keep)[0].outputs[0].text == dec(toks[: first + 1])
    eng = llm.engine
    req = eng.add_request("heaven", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]))
    streamed = ""
    while eng.has_unfinished():
        eng.step()
        streamed += "".join(c.text for c in req.output(delta=True).outputs)
    assert streamed == o.text
    eos = llm.tokenizer.eos_token_id
    force = {eos: 100.0}
    o = llm.generate(["heaven"], SamplingParams(max_tokens=8, logit_bias=force))[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids == [eos] and o.text == ""
    shown = SamplingParams(max_tokens=8, logit_bias=force, skip_special_tokens=False)  # its text exists, and is left out
    assert llm.generate(["heaven"], shown)[0].outputs[0].text == ""
    shown = SamplingParams(max_tokens=8, logit_bias=force, skip_special_tokens=False, include_stop_str_in_output=True)
    assert llm.generate(["heaven"], shown)[0].outputs[0].text == dec([eos])
    o = llm.generate(["heaven"], SamplingParams(max_tokens=8, logit_bias=force, ignore_eos=True))[0].outputs[0]
    assert o.finish_reason == "length" and o.token_ids == [eos] * 8
    o = llm.generate(["heaven"], SamplingParams(max_tokens=8, logit_bias=force, min_tokens=3))[0].outputs[0]
    assert o.finish_reason == "stop" and len(o.token_ids) == 4 and o.token_ids[-1] == eos


def test_logprobs_top_alternatives(llm):
    out = llm.generate(["the face of"], SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True))
    o = out[0].outputs[0]
    assert len(o.logprobs) == 6
    total = 0.0
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp.token_id == tok and len(lp.top) == 5
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6  # greedy picks the best
        assert lp.logprob <= 0
        total += lp.logprob
    assert abs(o.cumulative_logprob - total) < 1e-4
    no = llm.generate(["the face of"], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0]
    assert no.logprobs is None


def test_text_equals_decode_of_tokens(llm):
    out = llm.generate(["Ünïcödé"], SamplingParams(max_tokens=40, temperature=1.5, seed=3, ignore_eos=True))
    o = out[0].outputs[0]
    assert o.text == llm.tokenizer.decode(o.token_ids, skip_special_tokens=True)


def test_incremental_detokenizer_multibyte(llm):
    text = "naïve café, 東京, emoji 🙂 and more 🙂東"
    toks = ids(llm, text)
    d = IncrementalDetokenizer(llm.tokenizer, [], skip_special_tokens=True)
    pieces = [d.add(t) for t in toks]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # a token that ends mid-character yields nothing until the character completes
    assert any(p == "" for p in pieces) or all(len(llm.tokenizer.decode([t])) for t in toks)


def test_validation_errors_leave_engine_serving(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 600])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=512))
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate([[5, 100000]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["hi"], SamplingParams(max_tokens=0))
    for bad in ([5, 6.7], [5, True], torch.tensor([5.0, 6.0])):  # refused, not truncated to other tokens
        with pytest.raises(ValueError, match="integer"):
            eng.add_request(bad, SamplingParams(max_tokens=2))
    assert eng.add_request(torch.tensor([5, 6]), SamplingParams(max_tokens=1)).prompt_ids == [5, 6]
    while eng.has_unfinished():
        eng.step()
    assert llm.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].finish_reason == "length"
    assert_idle(eng)


def raising_on_call(n: int, error: type[BaseException]):
    """A logits processor factory whose processor raises `error` on its n-th call."""
    def factory():
        calls = []

        def proc(output_ids, logits):
            calls.append(1)
            if len(calls) == n:
                raise error("from a logits processor")
        return proc
    return factory


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_step_that_raises_leaves_no_request_and_no_slot_behind(llama_ckpt, overlap, error):
    """A step that raises part-way -- a logits processor's error, a Ctrl-C in
    the forward pass -- after its KV slots were allocated: `generate` raises,
    its requests are aborted (none runs on, unreturned, in the next call), the
    step's slots go back (the invariant check after every step would find a
    leak), and the next call is served."""
    llm = LLM(llama_ckpt, check_invariants=True, overlap_schedule=overlap)
    prompts = [ids(llm, "In the beginning"), ids(llm, "And God said"), ids(llm, "Let there be")]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logits_processor_factory=raising_on_call(4, error)),
              SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)]
    with pytest.raises(error, match="from a logits processor"):
        llm.generate(prompts, params)
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    assert_idle(llm.engine)
    out = llm.generate(prompts[1:], SamplingParams(max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    assert_idle(llm.engine)


def test_a_step_that_raises_after_a_row_ended_frees_the_rest_once(llama_ckpt):
    """The overlap schedule: a row whose token in flight a stop token ends
    has its next row's slots freed as the step before finishes; a processor
    that then raises in the same iteration unwinds the step's other rows
    only (freeing every row's slots freed that one twice: the check after
    the step finds a slot in the free list twice). The other request stops
    at each of its first greedy tokens in turn, so that one of them ends in
    the iteration of the raise."""
    llm = LLM(llama_ckpt, check_invariants=True, overlap_schedule="on")
    other = ids(llm, "And God said")
    greedy = llm.generate([other], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0]
    for stop in greedy.token_ids[:6]:
        with pytest.raises(RuntimeError, match="from a logits processor"):
            llm.generate([ids(llm, "In the beginning"), other],
                         [SamplingParams(max_tokens=12, ignore_eos=True,
                                         logits_processor_factory=raising_on_call(4, RuntimeError)),
                          SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop])])
        assert_idle(llm.engine)


@pytest.mark.parametrize("kw,says", [
    (dict(cpu_threads=100000), "cpu_threads must be at most"),  # torch's set_num_threads crashed (SIGSEGV)
    (dict(cpu_threads=1.5), "cpu_threads must be a positive integer"),
    (dict(kv_slots=10**13), "kv_slots must be at most"),
    (dict(kv_memory_gb=float("inf")), "kv_memory_gb must be a positive finite"),
    (dict(device="foo"), "device must be auto, cpu or cuda"),
    (dict(seed="abc"), "seed must be an integer"),
    (dict(branch_policy=None), "branch_policy must be a string"),
    (dict(policies=["noop"]), "is not a step policy"),
])
def test_engine_options_out_of_range_or_of_the_wrong_kind_are_refused_by_name(kw, says):
    """Each was a crash, a foreign exception or a silent acceptance (found by fuzzing)."""
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kw)


def test_generate_takes_ids_of_any_integer_kind_and_refuses_what_is_not_a_prompt(llm):
    """A 1-D tensor or array of ids is one prompt, a 2-D one a prompt per row,
    a list of NumPy ints one prompt; bytes, parameters that are not
    SamplingParams, a message without content and a step log that LLM would
    never write are refused by name."""
    import numpy as np

    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    for prompt in (torch.tensor([5, 6, 7]), np.array([5, 6, 7]), [np.int64(5), np.int64(6), np.int64(7)]):
        out = llm.generate(prompt, p)
        assert len(out) == 1 and out[0].outputs[0].token_ids == want
    assert [o.outputs[0].token_ids for o in llm.generate(np.array([[5, 6, 7], [5, 6, 7]]), p)] == [want, want]
    with pytest.raises(ValueError, match="not bytes"):
        llm.generate([b"abc"], p)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
        llm.generate(["hi"], {"max_tokens": 3})
    with pytest.raises(ValueError, match="a message is a dict with a role and its content"):
        llm.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="step_log is written by the serving loop"):
        LLM(llm.engine.model_dir, step_log="steps.jsonl")
    assert_idle(llm.engine)


def test_out_of_vocab_token_ids_refused_at_entry(llm):
    """Token ids are range-checked once, as a request enters (the sampler does
    not check them again each step): an id >= vocab_size is a ValueError naming
    the parameter, raised before anything is queued."""
    eng = llm.engine
    V = eng.model_config.vocab_size
    for prompt, params, name in [
        ([5, V], None, "prompt"),
        ("hi", SamplingParams(stop_token_ids=[V]), "stop_token_ids"),
        ("hi", SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
        ("hi", SamplingParams(logit_bias={str(V): 1.0}), "logit_bias"),  # JSON-style key
    ]:
        with pytest.raises(ValueError, match="out of vocabulary" if name == "prompt" else f"^{name}") as e:
            llm.generate([prompt], params)
        assert e.value.param == name
        assert not eng.requests and not eng.scheduler.waiting
        with pytest.raises(ValueError) as e:
            eng.add_request(prompt, params)
        assert e.value.param == name and not eng.requests
    # the last id of the vocabulary is accepted everywhere
    last = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, stop_token_ids=[V - 1],
                          logit_bias={V - 1: -1.0})
    assert len(llm.generate([[5, V - 1]], last)[0].outputs[0].token_ids) <= 2
    assert_idle(eng)


def test_step_policy_hook_sees_every_step(llama_ckpt):
    """A policy plans before each step and observes its StepRecord; a policy
    that defers rows (as branch admission will) changes nothing but timing."""
    from stepserve.engine.engine import Engine, EngineConfig

    class DeferOddSteps:
        name = "defer-odd"

        def __init__(self):
            self.planned, self.records = 0, []

        def plan(self, plan, view):
            self.planned += 1
            assert view.kv_capacity > 0 and view.num_running >= 0
            if self.planned % 2 and len(plan.rows) > 1:
                # keep the first row only; the others wait a step, keeping their KV
                plan.rows = plan.rows[:1]
            return plan

        def observe(self, plan, record):
            assert record.rows == len(plan.rows)
            assert record.new_tokens == sum(r.num_new for r in plan.rows)
            self.records.append(record)

    pol = DeferOddSteps()
    eng = Engine(EngineConfig(model=llama_ckpt, policies=[pol], check_invariants=True))
    ref = LLM(llama_ckpt)
    prompts = ["In the beginning", "And God said", "Let there be light"]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    reqs = [eng.add_request(x, p) for x in prompts]
    while eng.has_unfinished():
        eng.step()
    assert pol.planned == len(pol.records) == eng.step_id
    assert [r.output(delta=False).outputs[0].token_ids for r in reqs] == [
        o.outputs[0].token_ids for o in ref.generate(prompts, p)]
    assert_idle(eng)


def test_step_records_say_which_steps_ran_a_new_shape(llama_ckpt):
    """A step whose forward has a shape (tokens, logits rows) the engine had
    not run before is marked cold in its StepRecord (its time holds one-off
    work); the same shape again is not."""
    llm = LLM(llama_ckpt)
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm.generate(["In the beginning"], p)
    first = list(llm.engine.records)
    assert first[0].cold  # the prefill
    assert first[1].cold and first[1].decode_rows == 1  # the first decode step
    assert not any(r.cold for r in first[2:])  # more decode steps of one row: the same shape
    n = len(llm.engine.records)
    llm.generate(["In the beginning"], p)  # a prefix-cache hit: a 1-token prefill, then the same decode steps
    again = list(llm.engine.records)[n:]
    assert not any(r.cold for r in again[1:])
    two = len(llm.engine.records)
    llm.generate(["In the beginning", "And God said"], p)
    assert any(r.cold and r.decode_rows == 2 for r in list(llm.engine.records)[two:])


@pytest.mark.parametrize("name", ["prefix_caching", "enforce_eager", "check_invariants"])
def test_a_switch_given_as_a_string_is_refused(name):
    # "no" is truthy: taken as it is, prefix_caching="no" would turn caching on
    with pytest.raises(ValueError, match=f"{name} must be True or False"):
        EngineConfig(**{name: "no"})


def test_flush_cache_frees_every_prefix_no_request_holds(llm):
    """`LLM.reset_prefix_cache` / `Engine.flush_cache`: a prompt served before
    is a prefix hit, and after a flush a miss; a flush while a request runs
    keeps that request's prefix (it finishes as it would have) and frees the
    rest, with the KV accounts whole after each."""
    eng = llm.engine
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    a = ids(llm, "In the beginning God created the heaven and the earth. And the earth was without form")
    b = ids(llm, "And God said, Let there be light: and there was light. And God saw the light")
    first = llm.generate([a, b], greedy)
    assert llm.generate([a], greedy)[0].num_cached_tokens == len(a) - 1  # warm: all but the last prompt token
    assert llm.reset_prefix_cache() is True
    assert_idle(eng)
    assert eng.scheduler.kv.tree.total_size() == 0
    slots = eng.scheduler.kv.allocator.alloc(3)  # laid out again as in a fresh pool: the lowest slots first
    assert slots.tolist() == [1, 2, 3]
    eng.scheduler.kv.allocator.free(slots)
    cold = llm.generate([a], greedy)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first[0].outputs[0].token_ids

    # a flush between steps of a running request: its prefix stays, b's cached KV goes
    llm.generate([b], greedy)
    req = eng.add_request(a, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    while len(req.output(delta=False).outputs[0].token_ids) < 3:
        eng.step()
    tree = eng.scheduler.kv.tree
    evictable, held = tree.evictable_size(), tree.protected_size()
    assert evictable >= len(b) and held >= len(a) - 1  # b's prompt and output; a's prompt, locked by a
    f = eng.flush_cache()
    assert (f.freed, f.held) == (evictable, held) and tree.total_size() == held
    eng.check()
    while eng.has_unfinished():
        eng.step()
    out = req.output(delta=False).outputs[0].token_ids
    assert out[:6] == first[0].outputs[0].token_ids and len(out) == 12
    assert_idle(eng)
    assert llm.generate([b], greedy)[0].num_cached_tokens == 0  # flushed while a ran
    assert llm.generate([a], greedy)[0].num_cached_tokens == len(a) - 1  # a's own, kept and cached on finishing
