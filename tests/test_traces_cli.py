"""The trace commands' outputs, through `stepserve.cli.main`: every file they
write lands in folders created on demand, `replay --compare` warns when the
reports ran different workloads, and `profile` counts what it measured the
same way in every line it prints. Simulations use a roofline profile (no
model, a second or so each); the profile run is a tiny sweep on a random
checkpoint. No timing thresholds."""

from __future__ import annotations

import json
import re

import pytest

from stepserve.cli import main
from stepserve.traces.load import load_trace

TRACE = "synthetic:num=30,rate=20,input=uniform:16:64,output=uniform:4:16,seed=1"


def _simulate(out, *extra, trace=TRACE):
    assert main(["simulate", "--trace", trace, "--profile", "h100:qwen3-8b", "--out", str(out), "--no-progress",
                 *extra]) == 0
    return str(out)


def test_outputs_create_missing_folders(tmp_path, capsys):
    out = tmp_path / "bench-out" / "sim" / "report.json"
    plot = tmp_path / "plots" / "sim.png"
    saved = tmp_path / "traces" / "scaled.jsonl"
    _simulate(out, "--plot", str(plot), "--save-trace", str(saved))
    assert json.loads(out.read_text())["num_requests"] == 30
    assert plot.stat().st_size > 0
    assert len(load_trace(str(saved)).specs) == 30
    # the comparison's plot
    cmp_plot = tmp_path / "compare" / "a-vs-b.png"
    assert main(["replay", "--compare", str(out), str(out), "--plot", str(cmp_plot)]) == 0
    assert cmp_plot.stat().st_size > 0


def test_compare_warns_when_workloads_differ(tmp_path, capsys):
    a = _simulate(tmp_path / "a.json")
    same = _simulate(tmp_path / "same.json", "--admission", "lpm")  # another engine, the same workload
    scaled = _simulate(tmp_path / "scaled.json", "--limit", "12", "--length-scale", "0.5", "--rate", "5")
    other = _simulate(tmp_path / "other.json", trace=TRACE.replace("seed=1", "seed=2"))
    capsys.readouterr()

    assert main(["replay", "--compare", a, same]) == 0
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "WARNING" not in out

    assert main(["replay", "--compare", a, scaled, other]) == 0
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "vs a" in out  # the comparison is kept
    warning = out[out.index("WARNING"):]
    assert "different workloads" in warning
    scaled_part = warning[warning.index("scaled vs a:"):warning.index("other vs a:")]
    assert "requests: 30 vs 12" in scaled_part
    for knob in ("limit None vs 12", "input_scale 1 vs 0.5", "output_scale 1 vs 0.5", "rate None vs 5"):
        assert knob in scaled_part
    assert "trace:" not in scaled_part
    other_part = warning[warning.index("other vs a:"):]
    assert "trace: " + TRACE in other_part and TRACE.replace("seed=1", "seed=2") in other_part
    assert "requests:" not in other_part and "scaling:" not in other_part


def test_profile_counts_points_alike_and_shows_progress(llama_ckpt, tmp_path, capsys):
    """A round's scenario runs are fewer than its points (a prefill run times one
    point per chunk); every round line and the final line count the points the
    profile holds."""
    out = tmp_path / "new" / "prof.json"
    rc = main(["profile", "--model", llama_ckpt, "--batch-sizes", "1,2", "--context-lens", "16",
               "--chunk-sizes", "32", "--mixed-batch-sizes", "2", "--repeats", "1", "--warmup", "0",
               "--rounds", "2", "--max-batched-tokens", "256", "--out", str(out)])
    assert rc == 0
    prof = json.loads(out.read_text())
    points = prof["points"]
    samples = sum(len(p["raw_times"]) for p in points)
    captured = capsys.readouterr()
    rounds = re.findall(r"round (\d)/2 \(\d+ s\): (\d+) scenario runs; so far (\d+) points \(.*\) "
                        r"from (\d+) timed samples", captured.err)
    assert [r[0] for r in rounds] == ["1", "2"]
    # decode (1, 16), decode (2, 16), prefill 32 (an 80-token prompt: 3 chunks), mixed (2, 16, 32)
    assert {int(r[1]) for r in rounds} == {4}
    assert len(points) == 6 and {int(r[2]) for r in rounds} == {6}  # the second round adds no points...
    assert int(rounds[1][3]) == samples > int(rounds[0][3])  # ...only samples
    final = re.search(r"^(\d+) points \((\d+) decode, (\d+) prefill, (\d+) mixed\) from (\d+) timed samples "
                      r"over 2 rounds", captured.out, re.M)
    assert final and tuple(map(int, final.groups())) == (6, 2, 3, 1, samples)
    assert "8/8" in captured.err  # the progress bar: 2 rounds x 4 runs


@pytest.mark.parametrize("name", ["report.json", "bench-out/offline/report.json"])
def test_write_report_creates_folders(tmp_path, monkeypatch, name):
    """`bench offline`, `bench serve` and `profile` write through `write_report`
    too; a bare file name writes into the working directory."""
    from stepserve.traces.report import write_report

    monkeypatch.chdir(tmp_path)
    write_report({"x": 1}, name)
    assert json.loads((tmp_path / name).read_text()) == {"x": 1}


@pytest.mark.parametrize("argv,says", [
    (["simulate", "--trace", "/nonexistent/trace.csv", "--profile", "h100:llama3-8b"], "trace not found"),
    (["simulate", "--trace", "/dev/null", "--profile", "h100:llama3-8b"], ""),
    (["simulate", "--trace", "synthetic:num=4,rate=-1", "--profile", "h100:llama3-8b"], "rate"),
    (["simulate", "--trace", "synthetic:num=4,input=uniform:5:1", "--profile", "h100:llama3-8b"], ""),
    (["replay", "--trace", "synthetic:num=2,rate=1", "--url", "http://127.0.0.1:9", "--no-progress"],
     "http://127.0.0.1:9"),
    (["replay", "--compare", "/nonexistent/a.json", "/nonexistent/b.json"], "No such file"),
    (["generate", "--max-tokens", "0", "hello"], "max_tokens"),
    (["generate", "--max-running", "0", "hello"], "max_running must be a positive integer"),
    (["generate", "--spec-length", "fixed:2", "hello"], "spec_length is given but speculative is 'none'"),
    (["generate", "--max-model-len", "5000", "hello"], "max_model_len 5000 is more than the model's context (1024"),
    # (each of these was a traceback, a crash or a hang: found by fuzzing)
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--rates", "1,nan"], "--rates: give positive finite"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--rates", "1,inf"], "--rates: give positive finite"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--rates", "1,2", "--rate", "5"],
     "give --rate or --rates, not both"),
    (["generate", "--cpu-threads", "100000", "hello"], "cpu_threads must be at most 1024"),
    (["generate", "--kv-slots", "10000000000000", "hello"], "kv_slots must be at most"),
    (["generate", "--kv-memory-gb", "inf", "hello"], "kv_memory_gb must be a positive finite number"),
    (["generate", "--device", "foo", "hello"], "device must be auto, cpu or cuda"),
    (["generate", "--tokenizer", "/nonexistent", "hello"], "'/nonexistent' is not a directory"),
    (["bench", "offline", "--input-len-min", "100", "--input-len-max", "10"], "--input-len-min (100) is above"),
    (["replay", "--compare", "tests/fake_flashinfer.py"], ""),  # not JSON
    (["validate", "--trace", TRACE, "--replays", "pyproject.toml", "--profile", "h100:llama3-8b", "--rates", "1,2",
      "--slo-ttft", "0.1", "--slo-tpot", "0.01"], "--replays pyproject.toml: a file, not a folder"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--start", "100000"],
     "no request of the trace falls in the window"),
    (["replay", "--compare", "pyproject.toml", "--trace", TRACE], "--trace does not apply"),
])
def test_a_user_mistake_is_one_line_not_a_traceback(argv, says, monkeypatch):
    """A bad value, a missing file or an unreachable server ends the command
    with one `stepserve: ...` line (exit status 1), not a traceback."""
    monkeypatch.delenv("STEPSERVE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert isinstance(e.value.code, str) and e.value.code.startswith("stepserve: ") and says in e.value.code
    assert "\n" not in e.value.code


def test_the_traceback_of_a_user_mistake_on_request(monkeypatch):
    """STEPSERVE_TRACEBACK=1: the error rises as it is, with its traceback."""
    monkeypatch.setenv("STEPSERVE_TRACEBACK", "1")
    with pytest.raises(ValueError, match="max_running must be a positive integer"):
        main(["generate", "--max-running", "0", "hello"])


def test_serve_refuses_a_port_out_of_range(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "99999"])
    assert e.value.code == 2 and "a TCP port is 0-65535, not 99999" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--limit", "-1"], "--limit: must be at least 1"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--slo-tpot", "-1"], "--slo-tpot: must be a"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--slo-tpot", "nan"], "--slo-tpot: must be a"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--rate", "0"], "--rate: must be a"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--max-concurrency", "0"],
     "--max-concurrency: must be at least 1"),
    (["profile", "--holdout", "1.5"], "--holdout: must lie strictly between 0 and 1"),
    (["validate", "--trace", TRACE, "--repeats", "0"], "--repeats: must be at least 1"),
    (["validate", "--trace", TRACE, "--speed-window", "0"], "--speed-window: must be a"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--start", "nan"], "--start: must be a finite"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--duration", "0"], "--duration: must be a"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--kv-slots", "0"], "--kv-slots: must be at least 1"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--check-every", "-1"],
     "--check-every: must be at least 0"),
    (["simulate", "--trace", TRACE, "--profile", "h100:llama3-8b", "--max-context", "1"], "--max-context: must be at least 2"),
    (["replay", "--trace", TRACE, "--request-timeout", "0"], "--request-timeout: must be a"),
    (["replay", "--trace", TRACE, "--warmup", "-1"], "--warmup: must be at least 0"),
    (["bench", "offline", "--num-prompts", "0"], "--num-prompts: must be at least 1"),
    (["bench", "offline", "--repeats", "0"], "--repeats: must be at least 1"),
])
def test_option_values_out_of_range_are_refused_by_name(argv, says, capsys):
    """A count, time or share out of its range is an argparse error naming
    the option, before anything runs (a --limit of -1 dropped the last
    request, a TPOT SLO of -1 ran and met nothing, a holdout of 0 held out
    nothing)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
