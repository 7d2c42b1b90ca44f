"""OpenAI's error body and the exception handlers that produce it.

Every failure a client can cause ends as ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status; a dead engine gives a 503, and only a
bug in the server a 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from stepserve.engine.async_engine import EngineDeadError

log = logging.getLogger("stepserve.server")


class SafeJSONResponse(Response):
    """JSON that never fails to encode: user text echoed back (a model name, a
    stop string) may hold lone surrogates, which UTF-8 cannot carry."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8", errors="replace")


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> SafeJSONResponse:
        return SafeJSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_unavailable(err: Exception) -> APIError:
    """What a request gets when the engine loop is gone (the server exits soon)."""
    return APIError(503, f"The engine is not available: {err}", "server_error", code="engine_dead")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    return describe_errors(exc.errors())


def describe_errors(errors, rename: Callable[[str], str] | None = None) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors (of a request body, or of a
    request built from one); `rename` maps the param to the client's name."""
    if not errors:
        return "Invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"We could not parse the JSON body of your request: {detail}".rstrip(": "), None
    if e.get("type") == "missing" and not loc:
        return "The request body is missing or is not a JSON object", None
    # drop pydantic's union-branch names ("str", "list[int]", "function-after[...]")
    # from the location: clients know the parameter, not our type tree
    names = [p for p in loc if not (p[:1].islower() and ("[" in p or p in ("str", "int", "float", "bool", "dict", "list")))]
    if "logit_bias" in names:  # its keys are token ids, not parameter names
        names = names[: names.index("logit_bias") + 1]
    param = ".".join(names) or None
    if param and rename is not None:
        param = rename(param)
    msg = e.get("msg", "invalid value")
    if e.get("type"):  # pydantic's error type, which vLLM's messages carry and clients match on
        msg += f" [type={e['type']}]"
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"Invalid value for '{param}': {msg}{more}" if param else f"{msg}{more}"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        first = (exc.errors() or [{}])[0]
        if isinstance(first.get("input"), bytes) and all(p == "body" for p in first.get("loc", ())):
            # a body FastAPI did not parse, for its Content-Type (`curl -d` sends a form's): say so, rather
            # than that the (JSON) body is not an object
            ctype = request.headers.get("content-type", "")
            msg = (f"The request body must be JSON sent with Content-Type: application/json; it came as "
                   f"{ctype!r}, so it was not read as JSON")
        return SafeJSONResponse(error_body(msg, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404:
            detail = f"Unknown route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            detail = f"Method {request.method} not allowed on {request.url.path}"
        err_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return SafeJSONResponse(error_body(detail, err_type, None, getattr(exc, "code", None)),
                                status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError):
        return engine_unavailable(exc).response()  # the death itself is logged once, not per request

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return SafeJSONResponse(error_body(f"Internal server error: {type(exc).__name__}", "server_error"), 500)
