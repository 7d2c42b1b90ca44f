"""A real uvicorn server on 127.0.0.1 and a free port, in a background thread,
for the server tests; plus helpers to scrape metrics and wait for idleness."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from stepserve import AsyncEngine
from stepserve.engine.engine import EngineConfig
from stepserve.server.app import create_app
from stepserve.server.serving import ServerSettings

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerThread:
    """`with ServerThread(ckpt, api_key=...) as srv:` -> srv.url, srv.engine, srv.app.

    The engine runs in its own process, as under `stepserve serve`
    (`engine_process=False`: a thread of this process)."""

    def __init__(self, model: str, served_model_name: str = "test-model", api_key: str | None = None,
                 max_queued_requests: int = 1024, engine_process: bool = True,
                 max_request_bytes: int | None = 8 << 20, enable_prompt_tokens_details: bool = False,
                 **engine_kwargs):
        engine_kwargs.setdefault("check_invariants", True)
        self.engine = AsyncEngine(EngineConfig(model=model, **engine_kwargs), process=engine_process)
        self.settings = ServerSettings(served_model_name=served_model_name, api_key=api_key,
                                       max_queued_requests=max_queued_requests, metrics_poll_s=0.2,
                                       max_request_bytes=max_request_bytes,
                                       enable_prompt_tokens_details=enable_prompt_tokens_details)
        self.app = create_app(self.engine, self.settings)
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=HOST, port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.engine.shutdown()

    # -- helpers -----------------------------------------------------------------
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}

    def kv_report(self, timeout: float = 30):
        """The engine's KV check, run on its loop (raises if the check fails)."""
        import asyncio

        try:
            return asyncio.run(asyncio.wait_for(self.engine.kv_report(), timeout))
        except asyncio.TimeoutError:
            raise AssertionError(f"engine loop did not answer (alive: {self.engine.is_alive()})") from None

    def wait_idle(self, timeout: float = 30) -> None:
        """Until the engine has nothing running or waiting and the server holds
        no admitted request (aborts cross threads asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            if not self.kv_report().busy and self.app.state.client.admission.in_flight == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError("server did not become idle")
            time.sleep(0.02)

    def assert_kv_clean(self) -> None:
        r = self.kv_report()
        assert r.protected == 0
        assert r.accounted == r.capacity

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", headers=self.headers(), timeout=30).text)


_LINE = re.compile(r"^([^\s{#]+)(\{[^}]*\})?\s+(\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """'name{labels}' -> value for every sample line."""
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def server_fixtures(model: str, api_key: str, **kwargs):
    """Module-scoped `srv` (a ServerThread on the llama test checkpoint) and
    `client` (a sync openai client for it) fixtures:
    `srv, client = server_fixtures(MODEL, KEY, kv_slots=..., max_running=...)`."""

    @pytest.fixture(scope="module")
    def srv(llama_ckpt):
        with ServerThread(llama_ckpt, served_model_name=model, api_key=api_key, **kwargs) as s:
            yield s

    @pytest.fixture(scope="module")
    def client(srv):
        import openai

        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0, timeout=60)
        yield c
        c.close()

    return srv, client


@contextlib.contextmanager
def served(model: str, **kw):
    with ServerThread(model, **kw) as srv:
        yield srv
