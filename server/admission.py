"""The bounded admission queue: the server counts the engine requests it has
accepted and not yet finished; past `max_running + max_queued` it answers 429
with `Retry-After` instead of queueing more. Everything accepted runs to its end
(or until its client leaves)."""

from __future__ import annotations

from stepserve.server.errors import APIError


class Admission:
    def __init__(self, max_running: int, max_queued: int, retry_after_s: int = 1):
        self.limit = max_running + max_queued
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False  # set on SIGTERM: no new work

    def check_fits(self, k: int, param: str = "prompt") -> None:
        """A request that needs more slots at once than the server ever grants
        can never be admitted: 400 naming `param`, not a 429 to retry in vain."""
        if k > self.limit:
            raise APIError(400, f"This request needs {k} engine requests at once; the server admits at most "
                                f"{self.limit} (--max-running plus --max-queued-requests)", param=param)

    def acquire(self, k: int = 1) -> "Ticket":
        """Takes k slots now or raises 429 (503 while shutting down; 400 where
        k could never fit, `check_fits`). Runs on the event loop thread, so the
        check-and-add needs no lock."""
        self.check_fits(k)  # (k: the request's prompts)
        if self.draining:
            raise APIError(503, "The server is shutting down", "server_error", code="server_shutting_down",
                           headers={"Retry-After": str(self.retry_after_s)})
        if self.in_flight + k > self.limit:
            raise APIError(
                429,
                f"Too many requests in flight ({self.in_flight} of {self.limit}); retry later",
                "requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += k
        return Ticket(self, k)


class Ticket:
    def __init__(self, admission: Admission, k: int):
        self.admission = admission
        self.k = k

    def release(self) -> None:
        if self.k:
            self.admission.in_flight -= self.k
            self.k = 0
