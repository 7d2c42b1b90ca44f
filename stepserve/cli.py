"""`stepserve` command line: serve, generate, bench, replay, simulate, validate, profile."""

from __future__ import annotations

import argparse
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options shared by every command that builds an engine."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model directory (default: the embedded KJV model)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-running", type=int, default=256, help="cap on sequences decoding at once")
    g.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (chunked prefill)")
    g.add_argument("--kv-slots", type=int, default=None, help="KV pool size in tokens")
    g.add_argument("--kv-memory-gb", type=float, default=None,
                   help="KV pool size in GiB when --kv-slots is not given (default: 1 on CPU; on a GPU, what "
                        "--gpu-memory-utilization leaves after the weights)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="share of the GPU's memory the engine may hold: weights, KV cache and activations (0.9)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "flashinfer"],
                   help="auto: flashinfer on CUDA where it imports, else torch (SDPA; on CPU the native decode "
                        "kernel where it builds)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every decode step launches its kernels from Python")
    g.add_argument("--mixed-step-graphs", default="auto", choices=["auto", "on", "off"],
                   help="run steps with prompt chunks as CUDA graphs cut at the attention calls, the attention "
                        "eager between them (auto: where decode steps run CUDA graphs)")
    g.add_argument("--overlap-schedule", default="auto", choices=["auto", "on", "off"],
                   help="schedule and launch each step while the one before runs on the GPU (auto: on CUDA "
                        "without speculative decoding)")
    g.add_argument("--admission", default="fcfs", choices=["fcfs", "lpm"])
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads of the engine's process (default: torch's, one per core)")
    add_branch_policy_arg(g)
    g.add_argument("--slo-ttft", type=float, default=None, metavar="S",
                   help="TTFT SLO in seconds that TAPER plans against for requests that bring none (slo_ttft)")
    g.add_argument("--slo-tpot", type=float, default=None, metavar="S",
                   help="TPOT SLO in seconds that TAPER plans against for requests that bring none (slo_tpot)")
    g.add_argument("--latency-profile", default=None, metavar="PATH",
                   help="a `stepserve profile` JSON: the step-latency model TAPER starts from (default: it "
                        "calibrates online, running eager for its first 32 branching steps)")
    add_speculative_args(g)


def _checked(parse):
    """An argparse `type` that keeps the text and reports `parse`'s ValueError as a usage error."""

    def check(v: str) -> str:
        try:
            parse(v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return v

    return check


def add_speculative_args(g) -> None:
    from stepserve.scheduler.speculation import PROPOSERS, SpecLengthSpec

    g.add_argument("--speculative", default="none", choices=list(PROPOSERS),
                   help="speculative decoding: none (the default), draft (a draft model, --draft-model) or ngram "
                        "(prompt lookup, no model); output is exact either way")
    g.add_argument("--draft-model", default=None, metavar="DIR",
                   help="the draft model for --speculative draft: a Hugging Face directory sharing the target's "
                        "tokenizer (default: the embedded draft, kjv-llama-draft)")
    g.add_argument("--speculative-token-map", default=None, metavar="PATH",
                   help="the tokens the draft model may propose: a JSON list or .pt tensor of token ids (a draft "
                        "over the frequent tokens reads less of its output head each step; output stays exact); "
                        "'none' for every token (default: the draft directory's speculative_token_map.json where "
                        "it has one, as the embedded draft does)")
    g.add_argument("--spec-length", type=_checked(SpecLengthSpec.parse), default=None, metavar="SPEC",
                   help="tokens drafted per row each step: none, fixed:K, or adaptive[:kmax=K,per_row=0|1,settle=N,probe=N] (the default: the k, "
                        "0 included, that maximises the step's expected tokens per second)")


def add_branch_policy_arg(g) -> None:
    from stepserve.scheduler.branch_admission import BranchAdmissionSpec

    g.add_argument("--branch-policy", type=_checked(BranchAdmissionSpec.parse), default="eager", metavar="SPEC",
                   help="which branch rows of a request with n > 1 decode each step: eager (all, the default), off "
                        "(one), cap:N, or taper[:rho=R,utility=concave|linear] (rows admitted while the predicted "
                        "step fits the batch's SLO slack: the requests' own slo_tpot/slo_ttft, else --slo-tpot/--slo-ttft)")


def engine_config(args):
    from stepserve.engine.engine import EngineConfig

    # (a combination argparse cannot check alone, such as taper without a TPOT SLO, is a ValueError: `main` prints it)
    return _engine_config(EngineConfig, args)


def _engine_config(EngineConfig, args):
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        kv_slots=args.kv_slots,
        kv_memory_gb=args.kv_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        mixed_step_graphs=args.mixed_step_graphs,
        overlap_schedule=args.overlap_schedule,
        admission=args.admission,
        prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        cpu_threads=args.cpu_threads,
        branch_policy=args.branch_policy,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
        latency_profile=args.latency_profile,
        speculative=args.speculative,
        draft_model=args.draft_model,
        spec_length=args.spec_length,
        speculative_token_map=args.speculative_token_map,
    )


def _generate(args) -> int:
    from stepserve import LLM, SamplingParams

    llm = LLM(config=engine_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    prompts = args.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    for out in llm.generate(prompts, params):
        print(f"{out.prompt}{out.outputs[0].text}")
        print("---")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stepserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p_gen = sub.add_parser("generate", help="offline generation for prompts given as arguments or on stdin")
    add_engine_args(p_gen)
    p_gen.add_argument("prompt", nargs="*")
    p_gen.add_argument("--max-tokens", type=int, default=64)
    p_gen.add_argument("--temperature", type=float, default=0.8)
    p_gen.add_argument("--sampling-seed", type=int, default=None)
    p_gen.set_defaults(func=_generate)

    p_serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p_serve)
    from stepserve.server.cli import add_serve_args, run_serve

    add_serve_args(p_serve)
    p_serve.set_defaults(func=run_serve)

    p_bench = sub.add_parser("bench", help="benchmarks")
    bsub = p_bench.add_subparsers(dest="bench", required=True)
    from stepserve.traces.bench_offline import add_args as add_offline_args, run as run_offline

    p_off = bsub.add_parser("offline", help="offline throughput vs transformers, and scheduler overhead")
    add_engine_args(p_off)
    add_offline_args(p_off)
    p_off.set_defaults(func=run_offline)

    from stepserve.traces.bench_serve import add_args as add_serve_bench_args, run as run_serve_bench

    p_bs = bsub.add_parser("serve", help="HTTP serving latency/throughput, against the offline path in one run")
    add_engine_args(p_bs)
    add_serve_bench_args(p_bs)
    p_bs.set_defaults(func=run_serve_bench)

    from stepserve.traces.profile import add_profile_args, run_profile
    from stepserve.traces.replay_cli import add_replay_args, run_replay
    from stepserve.traces.simulate_cli import add_simulate_args, run_simulate

    p_replay = sub.add_parser("replay", help="replay a trace against a server; goodput report (or --compare reports)")
    add_replay_args(p_replay)
    p_replay.set_defaults(func=run_replay)

    p_sim = sub.add_parser("simulate", help="simulate a trace: the real scheduler on a virtual clock")
    add_simulate_args(p_sim)
    p_sim.set_defaults(func=run_simulate)

    from stepserve.traces.validate import add_validate_args, run_validate

    p_val = sub.add_parser("validate", help="the simulator against a real server over a rate sweep: errors per rate")
    add_validate_args(p_val)
    p_val.set_defaults(func=run_validate)

    p_prof = sub.add_parser("profile", help="time engine steps over a sweep, fit the step-latency model")
    add_engine_args(p_prof)
    add_profile_args(p_prof)
    p_prof.set_defaults(func=run_profile)

    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except _USER_ERRORS as e:  # a bad value, file or URL: one line (STEPSERVE_TRACEBACK=1 shows where it rose)
        if os.environ.get("STEPSERVE_TRACEBACK", "0") != "0":
            raise
        raise SystemExit(f"stepserve: {user_message(e)}") from None


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (ValueError, OSError)
    try:
        import httpx
    except ImportError:
        return errors
    return errors + (httpx.HTTPError,)


_USER_ERRORS = _user_errors()


def user_message(e: BaseException) -> str:
    """What a user needs of an error their input caused: the message, and
    for a failed connection where it went."""
    text = str(e) or type(e).__name__
    request = getattr(e, "_request", None)  # httpx: the request that failed, if it got that far
    if request is not None and str(request.url) not in text:
        text = f"{request.method} {request.url}: {text}"
    return text


if __name__ == "__main__":
    sys.exit(main())
