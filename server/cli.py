"""`stepserve serve`: the engine behind uvicorn, with a graceful SIGTERM.

The engine loop runs in a child process (`AsyncEngine(process=True)`), so the
HTTP work and the step loop do not take turns on one GIL; unless
`--cpu-threads` says otherwise, it gets one torch thread per core but one, and
the front end the core left.

SIGTERM (or Ctrl-C): the listening socket closes and new requests on open
connections get 503; running requests get `--shutdown-timeout` seconds to
finish, then uvicorn cancels them (which aborts them in the engine); the engine
process stops and the server exits 0. If the engine process dies, streams in
flight end with an SSE error event, other requests get a 503, and the server
exits 1 within seconds, for a supervisor (systemd, Kubernetes, a shell loop)
to restart it.

Also runnable alone: `python -m stepserve.server.cli --model DIR`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

log = logging.getLogger("stepserve.server")

# A prompt of 128k token ids is ~1 MiB of JSON, and so is the text of 128k
# tokens; 8 MiB holds a batch of such prompts. Reading, parsing and validating
# a body run on the event loop, ~6 ms per MiB measured on this project's 2-core
# machine, so the limit also bounds how long one request can hold up the others.
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:  # (0: any free port)
        raise argparse.ArgumentTypeError(f"a TCP port is 0-65535, not {port}")
    return port


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=_port, default=8000)
    g.add_argument("--api-key", default=os.environ.get("STEPSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (env STEPSERVE_API_KEY)")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    g.add_argument("--enable-prompt-tokens-details", "--enable-cache-report", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens served by the radix "
                        "cache) on the OpenAI routes; off by default, as in vLLM and SGLang, whose flags these are")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests accepted beyond --max-running before answering 429")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="request bodies larger than this get 413 before they are read (default 8 MiB: "
                        "a body holds the event loop ~6 ms per MiB while it is read and parsed)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM")
    g.add_argument("--step-log", default=None, metavar="PATH",
                   help="append the engine loop's timeline to PATH, one JSON line per iteration (what "
                        "`stepserve profile --step-log` and `stepserve validate --step-log` read)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    g.add_argument("--engine-thread", action="store_true",
                   help="run the engine loop as a thread of the server process instead of a process of its own "
                        "(it then shares the GIL with the HTTP work: slower under load)")


def default_engine_threads() -> int:
    """torch threads for an engine in its own process: a core per thread but
    one, which the HTTP front end needs (more engine threads than that starve
    it, and the engine's second thread on small models mostly spins)."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def served_model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    from stepserve.engine.defaults import DEFAULT_MODEL

    return os.path.basename(os.path.normpath(args.model or DEFAULT_MODEL))


def run_serve(args) -> int:
    import uvicorn

    from stepserve.cli import engine_config
    from stepserve.engine.async_engine import AsyncEngine
    from stepserve.engine.engine_process import freeze_heap
    from stepserve.server.app import create_app
    from stepserve.server.serving import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_cfg = engine_config(args)
    engine_cfg.step_log = args.step_log
    if not args.engine_thread and engine_cfg.cpu_threads is None:
        engine_cfg.cpu_threads = default_engine_threads()
    engine = AsyncEngine(engine_cfg, process=not args.engine_thread)
    settings = ServerSettings(
        served_model_name=served_model_name(args),
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    died: list[BaseException] = []

    def engine_died(err: BaseException) -> None:
        died.append(err)
        server.should_exit = True  # in-flight requests already failed; exit so a supervisor restarts us

    app = create_app(engine, settings, on_engine_death=engine_died)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, lifespan="on",
                            access_log=not args.no_access_log)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.client.admission.draining = True  # requests on kept-alive connections get 503
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal it caught once it has shut down; with our own
    # handlers in place beforehand, that lands here instead of killing us with 143.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log.info("serving %s on http://%s:%d", settings.served_model_name, args.host, args.port)
    freeze_heap()  # the front end's (and with --engine-thread the engine's) start-up objects live as long as it
    server = Server(config)
    try:
        server.run()
    finally:
        engine.shutdown()
    if died:
        log.error("exiting with status 1: the engine died (%s)", died[0])
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from stepserve.cli import add_engine_args

    p = argparse.ArgumentParser(prog="stepserve-serve", description=__doc__)
    add_engine_args(p)
    add_serve_args(p)
    return run_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
