"""Form bodies (`multipart/form-data`, `application/x-www-form-urlencoded`): what OpenAI's clients
send to some routes, and how a client uploads an image instead of base64 in JSON. The body is
read under the route's size limit first; the form parser then parses that copy."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import UploadFile
from starlette.requests import Request

from stepserve.deployments.errors import invalid

FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MAX_FORM_FIELDS = 64


@dataclass(frozen=True)
class Form:
    fields: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)  # the file parts' contents, by part name


async def read_form(request: Request, body: bytes, file_parts: Container[str] = (), max_files: int = 1) -> Form:
    """The form in `body`: each name once; file parts only under the names `file_parts` holds."""
    async def receive() -> dict[str, Any]:
        nonlocal body
        chunk, body = body, b""
        return {"type": "http.request", "body": chunk, "more_body": False}

    try:
        form = await Request(request.scope, receive).form(max_files=max_files, max_fields=MAX_FORM_FIELDS)
    except Exception as exc:  # starlette's parser errors are the client's malformed body
        raise invalid(None, f"malformed form body: {exc}", code="invalid_form") from None
    try:
        fields: dict[str, str] = {}
        files: dict[str, bytes] = {}
        for key, value in form.multi_items():
            if key in fields or key in files:
                raise invalid(key, f"{key}: given more than once")
            if isinstance(value, UploadFile):
                if key not in file_parts:
                    raise invalid(key, f"{key}: file uploads are not supported here", code="unsupported_value")
                files[key] = await value.read()
            else:
                fields[key] = value
        return Form(fields, files)
    finally:
        await form.close()


def is_form(request: Request) -> bool:
    return request.headers.get("content-type", "").split(";")[0].strip().lower() in FORM_TYPES
