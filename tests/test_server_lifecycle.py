"""`stepserve serve` as a real process: it starts from the CLI, serves, and on
SIGTERM stops taking requests, lets the running ones finish (or aborts them
past --shutdown-timeout) and exits 0."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from server_util import HOST, free_port


def start(ckpt, *extra):
    port = free_port()
    cmd = [sys.executable, "-m", "stepserve.cli", "serve", "--model", ckpt, "--host", HOST, "--port", str(port),
           "--kv-slots", "4096", "--max-running", "8", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://{HOST}:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


def stream_completion(url, body, out: dict, started: threading.Event, headers=None):
    """Reads an SSE completion to the end (or until the server cuts it)."""
    text, reasons = "", []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120,
                          headers=headers) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    if c["finish_reason"]:
                        reasons.append(c["finish_reason"])
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        started.set()
        out["text"], out["reasons"] = text, reasons


def test_sigterm_finishes_running_requests_and_exits_0(llama_ckpt):
    proc, url = start(llama_ckpt, "--served-model-name", "life", "--shutdown-timeout", "60")
    try:
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["life"]
        outs, threads = [], []
        for i in range(3):
            out, started = {}, threading.Event()
            body = {"model": "life", "prompt": f"running {i}", "max_tokens": 60, "ignore_eos": True}
            t = threading.Thread(target=stream_completion, args=(url, body, out, started))
            t.start()
            started.wait(60)
            outs.append(out)
            threads.append(t)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        code = proc.wait(120)
        log = proc.stdout.read()
        assert code == 0, log
        for out in outs:  # accepted before SIGTERM: completed, not cut
            assert out.get("done") and out["reasons"] == ["length"], (out, log)
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError("still listening after exit")
        except httpx.TransportError:
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_aborts_what_outlives_the_timeout_and_exits_0(llama_ckpt):
    proc, url = start(llama_ckpt, "--shutdown-timeout", "0.5", "--api-key", "k")
    try:
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        out, started = {}, threading.Event()
        body = {"prompt": "a long one", "max_tokens": 500, "ignore_eos": True}
        t = threading.Thread(target=stream_completion, args=(url, body, out, started, {"Authorization": "Bearer k"}))
        t.start()
        started.wait(60)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        code = proc.wait(120)
        assert code == 0, proc.stdout.read()
        assert out.get("status") == 200  # it was served until finished or cut at the timeout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_dead_engine_process_gives_503_not_a_hang(llama_ckpt):
    """If the engine process dies, /health says so and requests get a 503 in
    OpenAI's error format at once, instead of hanging."""
    import os

    from server_util import ServerThread

    with ServerThread(llama_ckpt, served_model_name="m", kv_slots=2048, max_running=4) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        os.kill(srv.engine._core._proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while srv.engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_dead"
        r = httpx.post(srv.url + "/v1/completions", timeout=30,
                       json={"model": "m", "prompt": "anyone there", "max_tokens": 2})
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "server_error"
