"""A small HTTP client for stepserve (the `openai` package works too; this adds the extensions)."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx

from stepserve.deployments.errors import APIError


class StepserveClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 300.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def __enter__(self) -> "StepserveClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def generate(self, prompt: str, **fields: Any) -> list[bytes]:
        """PNG bytes, one per image. `fields`: model, n, size, negative_prompt, num_inference_steps,
        guidance_scale, seed. Raises `APIError` with the server's status, code and param."""
        body = self._call("POST", "/v1/images/generations", json={"prompt": prompt, **fields})
        return [base64.b64decode(item["b64_json"]) for item in body["data"]]

    def models(self) -> list[str]:
        return [m["id"] for m in self._call("GET", "/v1/models")["data"]]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._http.get("/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"stepserve at {self._http.base_url} not ready after {timeout_s}s")
            time.sleep(0.5)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        response = self._http.request(method, path, **kwargs)
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
            except (ValueError, KeyError, TypeError):
                raise APIError(response.status_code, response.text[:500]) from None
            raise APIError(response.status_code, error.get("message", ""), param=error.get("param"),
                           code=error.get("code"), type=error.get("type"))
        return response.json()
