"""A short real replay against a server this test starts (`stepserve serve` in a
subprocess, on a random checkpoint), then the same trace simulated, and the
two reports compared. Checks shapes and exact token counts, never timings."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_util import free_port

TRACE = ("synthetic:num=16,rate=8,input=uniform:8:60,output=uniform:2:12,prefix_groups=2,prefix_len=24,"
         "turns=2,turn_gap_s=0.5,branch_fraction=0.25,branches=2,seed=3")


@pytest.fixture(scope="module")
def served(llama_ckpt, tmp_path_factory):
    """(url, step log path) of a server for this module."""
    port = free_port()
    folder = tmp_path_factory.mktemp("server")
    log = folder / "server.log"
    step_log = folder / "steps.jsonl"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stepserve.cli", "serve", "--model", llama_ckpt, "--port", str(port),
             "--host", "127.0.0.1", "--log-level", "warning", "--step-log", str(step_log),
             "--max-running", "48", "--max-batched-tokens", "1024",  # not the defaults: the profile reads the server's
             "--enable-prompt-tokens-details"],  # the replay's report counts prefix-cache hits from usage
            stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url, str(step_log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def test_real_replay_then_simulate_and_compare(server, tmp_path, capsys):
    from stepserve.cli import main
    from stepserve.traces.load import load_trace

    out = tmp_path / "real.json"
    saved = tmp_path / "scaled.jsonl"
    rc = main(["replay", "--trace", TRACE, "--url", server, "--slo-ttft", "5", "--slo-tpot", "1", "--out", str(out),
               "--save-trace", str(saved), "--plot", "--no-progress"])
    assert rc == 0
    rep = json.loads(out.read_text())
    specs = {s.request_id: s for s in load_trace(str(saved)).specs}
    assert rep["mode"] == "replay" and rep["num_requests"] == 16
    assert rep["num_completed"] == 16, [r["error"] for r in rep["requests"] if r["error"]]
    for r in rep["requests"]:
        s = specs[r["request_id"]]
        assert r["prompt_tokens"] == s.prompt_len
        assert r["output_tokens"] == s.output_len * s.n  # ignore_eos: exactly the trace's length
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
    assert any(r["cached_tokens"] for r in rep["requests"])  # the shared system prompts hit the radix cache
    assert rep["config"]["server_max_model_len"] == 512
    assert rep["scaling"]["applied"]["max_context"] == 512
    for key in ("duration_s", "throughput_rps", "output_tps", "goodput_rps", "goodput_tps", "slo_attainment"):
        assert isinstance(rep[key], float)
    assert (tmp_path / "real.png").stat().st_size > 0

    # the same scaled trace, simulated with a constant-step profile
    prof = {"kind": "stepserve-latency-profile", "source": "measured", "latency": {"form": "linear",
            "coef": [2e-3, 1e-4, 1e-7, 1e-5]}, "engine": {"kv_slots": 20000, "max_context": 512, "vocab_size": 384}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    sim_out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", str(saved), "--profile", str(tmp_path / "p.json"), "--slo-ttft", "5",
                 "--slo-tpot", "1", "--out", str(sim_out), "--no-progress"]) == 0
    sim = json.loads(sim_out.read_text())
    assert sim["num_completed"] == 16
    assert sim["total_output_tokens"] == rep["total_output_tokens"]
    capsys.readouterr()
    assert main(["replay", "--compare", str(out), str(sim_out)]) == 0
    table = capsys.readouterr().out
    assert "replay" in table and "simulate" in table
    assert "WARNING" not in table  # the saved trace is the same requests, though its labels differ


def test_profile_over_http_calibrates_from_the_step_log(served, llama_ckpt, tmp_path, capsys):
    """The HTTP sweep with the server's step log: the step model from the
    engine's own iterations, the serving costs measured, the client's points
    kept as a check."""
    from stepserve.cli import main
    from stepserve.scheduler.latency_model import ServingCosts, load_profile
    from stepserve.traces.simulator import SimConfig

    server, step_log = served
    out = tmp_path / "http.json"
    rc = main(["profile", "--url", server, "--model", llama_ckpt, "--batch-sizes", "1,2,4", "--context-lens", "16,40",
               "--chunk-sizes", "24", "--mixed-batch-sizes", "2", "--rounds", "1", "--repeats", "2", "--warmup", "1",
               "--step-log", step_log, "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    assert prof["source"] == "measured-http"
    scenarios = {p["scenario"] for p in prof["points"]}
    assert {"prefill", "hit", "mixed"} <= scenarios <= {"decode", "prefill", "hit", "mixed"}
    # each prompt went again after an idle wait: a full prefix hit, whose one token is a decode-shaped step
    assert all(p["new_tokens"] == 1 for p in prof["points"] if p["scenario"] == "hit")
    # every decode stream is accounted for: timed, or its tokens came merged into too few events to time (a
    # loaded machine's front end falls behind: seen on 2 cores under CI), and then it says so
    streams = prof["sweep"]["decode_streams"]
    assert streams["timed"] + streams["untimed"] == (1 + 2 + 4) * 2  # batch sizes x context lengths, one round
    assert ("decode" in scenarios) == (streams["timed"] > 0)
    captured = capsys.readouterr()
    assert ("decode streams could not be timed" in captured.err) == (streams["untimed"] > 0)
    assert prof["engine"]["max_context"] == 512 and prof["engine"]["kv_slots"] > 0
    assert "request_overhead_s" not in prof["engine"]
    # the engine as the server runs it (its /get_server_info), not as this command's default flags say
    eng = prof["engine"]
    assert (eng["max_running"], eng["max_batched_tokens"], eng["overlap_schedule"]) == (48, 1024, False)
    assert eng["kv_slots_from"] == "the server's /get_server_info"
    # and which prompt chunks it folds into decode-shaped queries, which the simulator then folds alike
    info = httpx.get(server + "/get_server_info").json()
    assert (eng["fold_tokens"], eng["fold_pairs"]) == (info["fold_tokens"], info["fold_pairs"])
    blocks = re.search(r'cache_config_info\{block_size="1",num_gpu_blocks="(\d+)"\}', httpx.get(server + "/metrics").text)
    assert eng["kv_slots"] == int(blocks.group(1))
    assert "the server runs max_running = 48 (--max-running here: 256)" in captured.err
    cal = prof["calibration"]
    assert cal["busy_steps"] >= 10 and cal["samples"]["delivery"] >= 1 and cal["samples"]["entry"] >= 1
    # the server kept the probes' KV: their hits ran one-row steps after idling, and the wake-up is read there
    assert cal["samples"]["wake_from"] == "hits"
    assert cal["form"] == prof["latency"]["form"] and cal["client_points"]["n"] == len(prof["points"])
    assert prof["target"].startswith("engine loop iteration")
    costs = ServingCosts.from_engine(prof["engine"])
    assert costs.entry_s > 0 and costs.delivery(1) > 0  # a real server spends time on both ways
    # the idle probes' third and last tokens: a later token's delivery, and the stream's end's
    assert cal["samples"]["token_delivery"] >= 1 and costs.token_delivery_s > 0
    assert cal["samples"]["end_delivery"] >= 1 and costs.end_delivery_s > 0
    # the host's work outside the engine, from the front end's CPU seconds on /metrics and the client's: passes
    # of 96 requests in turn: 16-token prompts, 1 or 33 tokens, 16 or 2 at a time, and 256-token prompts (half
    # the context); a request and the tokens streamed each cost the host something
    host = prof["host_work"]
    passes = host["passes"]
    assert [(p["requests"], p["prompt_tokens"], p["tokens"], p["at_once"]) for p in passes] == [
        (96, 96 * 16, 96, 16), (96, 96 * 16, 96 * 33, 16), (96, 96 * 16, 96 * 33, 2), (96, 96 * 256, 96, 16)] * 2
    assert all(p["front_end_cpu_s"] > 0 and p["client_cpu_s"] > 0 for p in passes)
    # the step log counted the batches of outputs the front end took in each pass: 2 at a time, many more
    assert all(p["batches"] >= p["tokens"] / p["at_once"] for p in passes)
    assert passes[2]["batches"] > 3 * passes[1]["batches"]
    assert costs.host_request_s == host["request_s"] > 0 and costs.host_token_s == host["token_s"]
    assert costs.host_batch_s == host["batch_s"] and costs.host_prompt_token_s == host["prompt_token_s"]
    assert costs.host_token_s + costs.host_batch_s > 0
    assert len(prof["noise"]["quantiles"]) == 101
    cfg = SimConfig.from_profile(prof["engine"], noise=prof["noise"])
    assert cfg.noise_quantiles and cfg.kv_slots == prof["engine"]["kv_slots"]
    assert (cfg.fold_tokens, cfg.fold_pairs) == (eng["fold_tokens"], eng["fold_pairs"])
    assert cfg.serving() == ServingCosts.from_engine(prof["engine"])
    # the mixed points carry the streams decoding beside each probe
    assert {p["streams"] for p in prof["points"] if p["scenario"] == "mixed"} == {2}
    assert load_profile(str(out)).model.predict(2, 100, 2) > 0
    # the round line, the final line and the file count the same points; the bar counts scenario runs:
    # 3 batch sizes x 2 contexts decode, prompts of 16, 24 and 40 tokens and the two long ones (256 and 510 of
    # the 512-token context), 1 batch size x 2 contexts mixed
    (round_points,) = re.findall(r"round 1/1 \(\d+ s\): 13 scenario runs; so far (\d+) points", captured.err)
    assert re.search(rf"^{len(prof['points'])} points \(.*\) from \d+ timed samples over 1 rounds", captured.out, re.M)
    assert int(round_points) == len(prof["points"])
    assert "13/13" in captured.err


def test_validate_replays_and_simulates_each_rate(served, tmp_path, capsys):
    """`stepserve validate` over two rates: per-rate tables, the engine's view
    from the server's step log, the judgement, JSON and plot."""
    from stepserve.cli import main

    url, step_log = served
    prof = {"kind": "stepserve-latency-profile", "source": "measured", "latency": {"form": "linear",
            "coef": [2e-3, 1e-4, 1e-7, 1e-5]},
            "engine": {"kv_slots": 20000, "max_context": 512, "vocab_size": 384, "delivery_s": 1e-3}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    out = tmp_path / "val.json"
    rc = main(["validate", "--trace", TRACE, "--rates", "4,16", "--url", url, "--profile", str(tmp_path / "p.json"),
               "--slo-ttft", "0.5", "--slo-tpot", "0.1", "--step-log", step_log, "--out", str(out), "--plot",
               "--replays", str(tmp_path / "runs"), "--no-progress"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["kind"] == "stepserve-validation" and [r["rate"] for r in res["rates"]] == [4, 16]
    for r in res["rates"]:
        assert r["real"]["num_completed"] == r["sim"]["num_completed"] == 16
        for key in ("ttft_p50", "tpot_p90", "itl_p99", "e2e_p50"):
            c = r["latency"][key]
            assert c["real"] > 0 and c["sim"] > 0 and c["error"] == pytest.approx(c["sim"] / c["real"] - 1)
        (eng,) = r["engine"]
        assert eng["steps"] > 0 and eng["busy_s"] > 0 and eng["step_ratio"]["p50"] > 0
        assert eng["entry_s"]["n"] >= 1  # the first request of each run finds the engine idle
        assert eng["loop_s"] > 0  # the loop's own time between busy steps
        assert eng["delivery_s"]["n"] == 16 and abs(eng["delivery_s"]["p50"]) < 0.5  # every first token, joined
        assert eng["end_delivery_s"]["n"] >= 1  # the last tokens of requests that decoded every step
        (paired,) = r["paired"]  # one run, against its own simulation
        assert paired["goodput"] == pytest.approx(r["goodput_error"])
    # each stored run carries the host's CPU beside the engine: the front end's (its /metrics) and the client's
    host = json.loads((tmp_path / "runs" / "rate0-run0.json").read_text())["host_cpu_s"]
    assert host["front_end"] >= 0 and host["client"] > 0
    assert res["simulator"]["delivery_s"] == 1e-3
    assert set(res["summary"]) >= {"goodput", "attainment", "ttft_p50", "tpot_p90", "knee", "all_met"}
    assert (tmp_path / "val.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "rate 4 req/s" in printed and "goals:" in printed and "engine:" in printed
    assert "each run against its own simulations: attainment" in printed and "loop between busy steps" in printed

    # --replays kept the real runs: a slower profile is validated against the same runs, with no server
    prof["latency"]["coef"][0] = 6e-3
    (tmp_path / "p2.json").write_text(json.dumps(prof))

    def from_stored_runs(profile: str, out: str, *more: str) -> int:  # no server: --url answers nothing
        return main(["validate", "--trace", TRACE, "--rates", "4,16", "--url", "http://127.0.0.1:9", "--profile",
                     str(tmp_path / profile), "--slo-ttft", "0.5", "--slo-tpot", "0.1", "--out", str(tmp_path / out),
                     "--replays", str(tmp_path / "runs"), "--no-progress", *more])

    assert from_stored_runs("p2.json", "v2.json") == 0
    again = json.loads((tmp_path / "v2.json").read_text())
    for a, b in zip(res["rates"], again["rates"]):
        assert a["real"] == b["real"] and a["latency"]["ttft_p50"]["real"] == b["latency"]["ttft_p50"]["real"]
        assert b["latency"]["tpot_p50"]["sim"] > a["latency"]["tpot_p50"]["sim"]  # the simulation did change
    # --speed-from-step-log: each simulation runs at its real run's measured speed, so a profile 3x off
    # in its intercept still simulates the engine's busy time; --sim-seeds: simulations per real run
    assert from_stored_runs("p2.json", "v3.json", "--step-log", step_log, "--speed-from-step-log",
                            "--sim-seeds", "2") == 0
    fast = json.loads((tmp_path / "v3.json").read_text())
    assert fast["simulator"]["speed_from_step_log"] is True
    for b, c in zip(again["rates"], fast["rates"]):
        assert c["simulations"] == 2 and c["repeats"] == 1
        (eng,) = c["engine"]
        assert abs(c["sim"]["busy_s"] / eng["busy_s"] - 1) < abs(b["sim"]["busy_s"] / eng["busy_s"] - 1)
    # --speed-window: the speed per quarter second of each run, each stretch of the simulation at its own
    # (a profile with step noise: told each window's speed, the simulation draws the scatter about it)
    prof["noise"] = {"quantiles": [0.5 + 0.01 * k for k in range(101)], "quantiles_within": [1.0] * 101}
    (tmp_path / "p3.json").write_text(json.dumps(prof))
    assert from_stored_runs("p3.json", "v4.json", "--step-log", step_log, "--speed-from-step-log",
                            "--speed-window", "0.25") == 0
    windowed = json.loads((tmp_path / "v4.json").read_text())
    assert windowed["simulator"]["speed_window_s"] == 0.25 and windowed["simulator"]["noise_within_windows"]
    for b, c in zip(again["rates"], windowed["rates"]):
        (eng,) = c["engine"]
        starts = [w[0] for w in eng["speed_windows"]]
        assert starts == [0.25 * k for k in range(len(starts))] and len(starts) >= 4  # a run lasts 1-4 s
        assert abs(c["sim"]["busy_s"] / eng["busy_s"] - 1) < abs(b["sim"]["busy_s"] / eng["busy_s"] - 1)
    with pytest.raises(SystemExit, match="speed-window"):
        main(["validate", "--trace", TRACE, "--rates", "4,16", "--profile", str(tmp_path / "p2.json"),
              "--slo-ttft", "0.5", "--replays", str(tmp_path / "runs"), "--speed-window", "1"])
    with pytest.raises(SystemExit, match="step-log"):
        main(["validate", "--trace", TRACE, "--rates", "4,16", "--profile", str(tmp_path / "p2.json"),
              "--slo-ttft", "0.5", "--replays", str(tmp_path / "runs"), "--speed-from-step-log"])
    with pytest.raises(SystemExit, match="rescales a measured"):
        main(["validate", "--trace", TRACE, "--rates", "4,16", "--profile", "h100:llama3-8b", "--slo-ttft", "0.5",
              "--replays", str(tmp_path / "runs"), "--step-log", step_log, "--speed-from-step-log"])
    # a rate the folder does not hold must be replayed: here, against no server, an error naming it
    with pytest.raises(SystemExit, match="http://127.0.0.1:9"):
        main(["validate", "--trace", TRACE, "--rates", "4,8", "--url", "http://127.0.0.1:9", "--profile",
              str(tmp_path / "p2.json"), "--slo-ttft", "0.5", "--slo-tpot", "0.1",
              "--replays", str(tmp_path / "runs"), "--no-progress"])


def test_each_replay_starts_from_a_flushed_prefix_cache(server, tmp_path):
    """A replay empties the server's prefix cache first (`--flush-cache`, on by
    default), so the same prompts sent again, by a second invocation with the
    same seed, miss the cache as a simulation's would; `--no-flush-cache`
    leaves them to hit. SGLang's and vLLM's routes both answer."""
    from stepserve.cli import main

    trace = "synthetic:num=6,rate=50,input=uniform:20:40,output=uniform:2:4,seed=5"  # no shared prefixes

    def run(name: str, *more: str) -> dict:
        out = tmp_path / f"{name}.json"
        assert main(["replay", "--trace", trace, "--url", server, "--seed", "11", "--out", str(out),
                     "--no-progress", *more]) == 0
        rep = json.loads(out.read_text())
        assert rep["num_completed"] == 6
        return rep

    first = run("first")
    assert first["config"]["cache_flush"]["route"] == "/flush_cache"
    warm = run("warm", "--no-flush-cache")
    assert warm["config"]["cache_flush"] is None
    assert [r["cached_tokens"] for r in warm["requests"]] == [r["prompt_tokens"] - 1 for r in warm["requests"]]
    cold = run("cold")
    assert [r["cached_tokens"] for r in cold["requests"]] == [0] * 6
    prompts = sum(r["prompt_tokens"] for r in first["requests"])
    assert cold["config"]["cache_flush"]["flushed_tokens"] >= prompts  # the prompts (and outputs) sent twice
    assert cold["config"]["cache_flush"]["held_tokens"] == 0

    for method, route in (("GET", "/flush_cache"), ("POST", "/flush_cache"), ("POST", "/reset_prefix_cache")):
        r = httpx.request(method, server + route, timeout=30)
        assert r.status_code == 200 and r.json()["object"] == "cache.flush", (route, r.text)
        assert r.json()["held_tokens"] == 0
        # the cold run's prompts, cached when it finished, go with the first; nothing is left for the others
        assert (r.json()["flushed_tokens"] >= prompts) if route == "/flush_cache" and method == "GET" \
            else r.json()["flushed_tokens"] == 0


def test_bench_serve_compares_http_with_offline_on_the_same_prompts(llama_ckpt, tmp_path, capsys):
    """`stepserve bench serve` starts its own server (engine in a child
    process), streams every prompt through it and through the offline engine,
    and reports each path, the overhead against each offline path and the
    server's CPU per request."""
    import torch

    from stepserve.cli import main

    out = tmp_path / "serve.json"
    threads = torch.get_num_threads()
    try:
        # enough work that each process's CPU time spans many of /proc's clock ticks (10 ms): with 12 requests
        # of 6 tokens the engine's read 0 ticks on a fast CPU
        rc = main(["bench", "serve", "--model", llama_ckpt, "--num-prompts", "16", "--max-concurrency", "4",
                   "--output-len", "48", "--input-len-min", "4", "--input-len-max", "12", "--repeats", "1",
                   "--kv-slots", "4096", "--cpu-threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)  # the offline engine set it for this whole process
    assert rc == 0
    rep = json.loads(out.read_text())
    assert set(rep["runs"]) == {"http", "offline"}  # --cpu-threads 1: the server's engine runs as offline does
    assert rep["offline_threads"] == {"offline": 1}
    for path, runs in rep["runs"].items():
        (r,) = runs
        assert r["num_failed"] == 0 and r["num_completed"] == 16, path
        assert r["output_tps"] > 0
    assert set(rep["http_overhead"]) == {"offline"}
    cpu = rep["server_cpu_ms_per_request"]
    assert cpu["frontend"] > 0 and cpu["engine"] > 0
    assert "HTTP path throughput vs offline" in capsys.readouterr().out


def _max_overlap(reqs) -> int:
    """The most requests in flight at once, from their [start, end] intervals."""
    events = sorted([(r["start_s"], 1) for r in reqs] + [(r["start_s"] + r["e2e_s"], -1) for r in reqs],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def test_max_concurrency_real_and_simulated(server, tmp_path):
    """Every request arrives at once; with --max-concurrency 2 the client keeps
    two in flight (the others are sent as those complete, and their TTFT counts
    from the send), in a real replay and in the simulator alike."""
    from stepserve.cli import main

    trace = "synthetic:num=8,rate=1000,input=fixed:16,output=fixed:6,branch_fraction=0.5,branches=2,seed=4"
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    assert main(["replay", "--trace", trace, "--url", server, "--max-concurrency", "2", "--out", str(real),
                 "--no-progress"]) == 0
    prof = {"kind": "stepserve-latency-profile", "source": "measured", "latency": {"form": "linear",
            "coef": [2e-3, 1e-4, 1e-7, 1e-5]}, "engine": {"kv_slots": 20000, "max_context": 512, "vocab_size": 384}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    assert main(["simulate", "--trace", trace, "--profile", str(tmp_path / "p.json"), "--max-concurrency", "2",
                 "--out", str(sim), "--no-progress"]) == 0
    for path in (real, sim):
        rep = json.loads(path.read_text())
        reqs = rep["requests"]
        assert rep["num_completed"] == 8 and rep["config"]["max_concurrency"] == 2
        assert _max_overlap(reqs) == 2, path
        # a request is sent at its arrival or later, and the third and each one after only once as many
        # as went before it, less the two slots, have completed (their E2E counts from the send)
        assert all(r["start_s"] >= r["arrival_s"] for r in reqs), path
        starts = sorted(r["start_s"] for r in reqs)
        ends = sorted(r["start_s"] + r["e2e_s"] for r in reqs)
        assert all(starts[k] >= ends[k - 2] - 1e-4 for k in range(2, len(reqs))), path


def test_fork_join_trace_replays_through_the_native_route(server, tmp_path):
    """A synthetic fork/join trace: replayed against a server (its fork/join
    requests go to /generate with their stages) it generates exactly every
    stage's tokens, as the simulator does for the same requests."""
    from stepserve.cli import main

    trace = ("synthetic:num=6,rate=20,input=fixed:12,output=fixed:3,fork_fraction=0.5,fork_branches=3,"
             "fork_suffix=fixed:2,fork_output=fixed:4,join_output=fixed:2,seed=5")
    real, saved = tmp_path / "real.json", tmp_path / "scaled.jsonl"
    assert main(["replay", "--trace", trace, "--url", server, "--out", str(real), "--save-trace", str(saved),
                 "--no-progress"]) == 0
    from stepserve.traces.load import load_trace

    specs = {s.request_id: s for s in load_trace(str(saved)).specs}
    assert any(s.stages for s in specs.values()) and any(not s.stages for s in specs.values())
    rep = json.loads(real.read_text())
    assert rep["num_completed"] == 6, [r["error"] for r in rep["requests"] if r["error"]]
    for r in rep["requests"]:
        s = specs[r["request_id"]]
        assert r["output_tokens"] == s.total_output and r["stages"] == 1 + len(s.stages)


def test_the_cli_and_the_replay_client_run_without_torch(server, tmp_path):
    """Building the command line and running the load generator import no
    torch (~1.3 s and ~250 MB a process): `stepserve --help`, `replay --help`
    and a replay against this module's server, in a fresh interpreter. The
    replay client shares a small machine with the server it measures."""
    out_path = tmp_path / "r.json"
    code = ("import sys\n"
            "from stepserve.cli import main\n"
            "for argv in (['--help'], ['replay', '--help'], ['replay', '--trace',\n"
            "             'synthetic:num=3,rate=50,input=fixed:8,output=fixed:4,seed=1',\n"
            f"             '--url', {server!r}, '--no-progress', '--out', {str(out_path)!r}]):\n"
            "    try:\n"
            "        main(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-2000:]
    assert json.loads(out_path.read_text())["num_completed"] == 3


def test_decode_time_per_token_holds_where_the_server_merged_events():
    """The HTTP profile's decode window reads each event's running token
    count: where the server's front end fell behind and sent several steps'
    tokens in one event, the time per token is still the steps' (a count of
    events would see fewer tokens, and the old per-event gaps dropped every
    such stream, so a loaded machine's profile had no decode points)."""
    from stepserve.traces.profile_http import window_time_per_token

    step = 0.004
    one_each = [(k * step, k) for k in range(1, 21)]  # token k arrives at k steps
    assert window_time_per_token(one_each, 5, 15) == pytest.approx(step)
    # tokens 6-8 and 12-13 came late, each group in one event with its last token
    merged = [(t, c) for t, c in one_each if c not in (6, 7, 12)]
    assert window_time_per_token(merged, 5, 15) == pytest.approx(step)
    # a merge across the window's start: the window starts at the first event past it
    late_start = [(t, c) for t, c in one_each if c not in (4, 5, 6)]
    assert window_time_per_token(late_start, 5, 15) == pytest.approx(step)
    # too little of the window left between events: no point
    assert window_time_per_token([(0.1, 3), (0.2, 16)], 5, 15) is None
    assert window_time_per_token([], 5, 15) is None


def test_the_replay_client_reuses_its_connections():
    """A stream's body ends after `data: [DONE]` with the chunked encoding's
    last chunk. The client reads to it, so aiohttp pools the connection and
    the next request reuses it: requests one after another go over one
    connection. Left unread, each request closed its connection and the next
    paid a new one (234 for 400 requests at 128 req/s), which the server's
    and the client's CPU time both carried. The server here is a minimal
    OpenAI-style SSE endpoint that sends the last chunk a little after
    [DONE], as a loaded front end may, and records each request's client
    port."""
    import asyncio

    from aiohttp import web

    from stepserve.traces.replay import Replayer, ReplayConfig, ServerInfo
    from stepserve.traces.request_spec import RequestSpec, Segment

    ports: list[int] = []

    async def completions(request):
        ports.append(request.transport.get_extra_info("peername")[1])
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(body["max_tokens"]):
            chunk = {"id": "cmpl-x", "choices": [{"index": 0, "text": "a", "token_ids": [5]}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(f"data: {json.dumps({'id': 'cmpl-x', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.02)  # the body's end comes in a later packet
        await resp.write_eof()
        return resp

    async def main():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            r = Replayer(ReplayConfig(url=f"http://127.0.0.1:{port}", model="m", warmup=0, progress=False),
                         ServerInfo("m", 64, 100))
            # each arrives after the one before has ended
            specs = [RequestSpec(f"r{k}", 0.15 * k, 3, (Segment(f"p{k}", 8),)) for k in range(6)]
            return await r.run(specs)
        finally:
            await runner.cleanup()

    records, _ = asyncio.run(main())
    assert [r.error for r in records] == [None] * 6
    assert [r.output_tokens for r in records] == [3] * 6
    assert all(r.first_token_s <= r.end_s for r in records)
    assert len(ports) == 6 and len(set(ports)) == 1, ports
