"""`RequestError`: what every refusal of a request raises, wherever it is
checked (sampling parameters, the core's limits), so a front end answers in
its own API's terms from `param` instead of parsing messages."""

from __future__ import annotations


class RequestError(ValueError):
    """A request refused as it enters, naming the request parameter at fault
    (`param`, in the engine's names: `prompt`, `max_tokens`, `temperature`...;
    None when no one parameter is) and, where one applies, an error `code`
    (`context_length_exceeded`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
