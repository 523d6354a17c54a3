"""5xx errors: OpenAI-shaped, quoting a request id, never leaking exception text; they pickle."""

import pickle

import pytest

from stepserve.deployments.errors import APIError, invalid, server_error


def test_server_error_body_and_headers():
    err = server_error("req-42")
    assert err.status == 500
    assert err.body() == {"error": {"message": "internal server error (request id: req-42)", "type": "server_error",
                                    "param": None, "code": "internal_error"}}
    assert err.headers() == {"x-request-id": "req-42"}


def test_unavailable_with_retry_after():
    err = server_error("r1", "worker_unavailable", "no denoiser worker is available", status=503, retry_after_s=2.2)
    assert (err.status, err.code, err.type) == (503, "worker_unavailable", "server_error")
    assert err.message == "no denoiser worker is available (request id: r1)"
    assert err.headers() == {"x-request-id": "r1", "retry-after": "3"}  # whole seconds, rounded up


def test_only_5xx_statuses():
    with pytest.raises(ValueError, match="5xx"):
        server_error("r", status=400)


def test_no_exception_text_reaches_the_body():
    try:
        raise RuntimeError("Traceback: actor 4f2c dead on node 10.0.0.7")
    except RuntimeError:
        err = server_error("r9")  # what an ingress does in its `except`: a fixed message only
    text = str(err.body()) + str(err.headers())
    assert "10.0.0.7" not in text and "4f2c" not in text and "Traceback" not in text
    assert err.body()["error"]["message"].endswith("(request id: r9)")


@pytest.mark.parametrize("err", [
    server_error("abc", status=503, retry_after_s=1),
    server_error("abc"),
    invalid("size", "bad size"),
    APIError(429, "queue full", code="rate_limit_exceeded", retry_after_s=0.5),
])
def test_pickling_keeps_everything(err):
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, APIError)
    assert (again.status, again.body(), again.headers(), again.request_id, again.retry_after_s) == (
        err.status, err.body(), err.headers(), err.request_id, err.retry_after_s)


def test_client_errors_have_no_headers_by_default():
    err = invalid("prompt", "prompt must not be empty")
    assert err.headers() == {} and err.request_id is None and err.type == "invalid_request_error"
