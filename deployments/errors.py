"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import math
from typing import Any


class APIError(Exception):
    """An error the caller should see as-is. Raised through handles too (it pickles).

    `request_id` and `retry_after_s` travel as the `x-request-id` and `retry-after` headers
    (see `headers`), not in the body, so the body keeps OpenAI's exact shape.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, request_id: str | None = None, retry_after_s: float | None = None):
        super().__init__(status, message, param, code, type)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.request_id = request_id
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        return f"{self.status} {self.code or self.type}: {self.message}{where}"

    def __reduce__(self):
        return (_rebuild, (self.status, self.message, self.param, self.code, self.type, self.request_id,
                           self.retry_after_s))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        out = {}
        if self.request_id is not None:
            out["x-request-id"] = self.request_id
        if self.retry_after_s is not None:
            # HTTP's Retry-After takes whole seconds; rounding up never invites an early retry.
            out["retry-after"] = str(max(0, math.ceil(self.retry_after_s)))
        return out


def _rebuild(status, message, param, code, type_, request_id, retry_after_s):
    return APIError(status, message, param=param, code=code, type=type_, request_id=request_id,
                    retry_after_s=retry_after_s)


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def server_error(request_id: str, code: str = "internal_error", message: str = "internal server error", *,
                 status: int = 500, retry_after_s: float | None = None) -> APIError:
    """A 5xx for the client: a fixed message plus the request id to quote to the operator.

    It takes no exception on purpose: exception text can hold tracebacks, node IPs and actor
    ids, which belong in the server log (keyed by the same request id), never in a response.
    """
    if not 500 <= status <= 599:
        raise ValueError(f"server_error needs a 5xx status, got {status}")
    return APIError(status, f"{message} (request id: {request_id})", code=code, type="server_error",
                    request_id=request_id, retry_after_s=retry_after_s)
