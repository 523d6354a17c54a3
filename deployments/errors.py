"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the caller should see as-is. Raised through handles too (it pickles)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(status, message, param, code, type)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def __str__(self) -> str:
        where = f" (param: {self.param})" if self.param else ""
        return f"{self.status} {self.code or self.type}: {self.message}{where}"

    def __reduce__(self):
        return (_rebuild, (self.status, self.message, self.param, self.code, self.type))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _rebuild(status, message, param, code, type_):
    return APIError(status, message, param=param, code=code, type=type_)


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)
