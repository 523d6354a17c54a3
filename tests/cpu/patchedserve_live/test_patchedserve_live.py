"""PatchedServe's SLO-aware policy in the live app: a request that cannot meet its deadline even run
now alone is given up at once, and its caller is told why in the OpenAI error shape (HTTP 429,
code `deadline_unattainable`; a handle caller gets the same `APIError`), while the requests that
can make it are served beside it."""

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from stepserve.deployments.errors import APIError

from tests.cpu.patchedserve_live.conftest import SLO_S

# 100 steps at 256 px under CFG: about 14 s alone by the profile (143 ms a step), past the SLO.
DOOMED = {"prompt": "a cathedral", "size": "256x256", "num_inference_steps": 100, "seed": 1}
# 3 steps at 64 px: about 60 ms.
SMALL = {"prompt": "a red fox", "size": "64x64", "num_inference_steps": 3}


def failed_requests(url: str) -> float:
    """The router's count of requests that ended FAILED."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "stepserve_requests_total" and sample.labels.get("status") == "failed":
                return sample.value
    return 0.0


def generate(client: openai.OpenAI, prompt: str, size: str, **extra):
    return client.images.generate(model="tiny-sd", prompt=prompt, size=size, response_format="b64_json",
                                  extra_body=extra)


def test_a_request_that_cannot_meet_its_deadline_is_refused_at_once_and_the_others_are_served(patchedserve_app):
    url, _ = patchedserve_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    failed = failed_requests(url)

    def doomed() -> tuple[openai.RateLimitError, float]:
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            generate(client, **DOOMED)
        return info.value, time.monotonic() - started

    with ThreadPoolExecutor(3) as pool:
        refused = pool.submit(doomed)
        small = [pool.submit(generate, client, seed=seed, **SMALL) for seed in (2, 3)]
        (error, waited), served = refused.result(), [f.result() for f in small]
    for response in served:
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json))))
        assert pixels.shape == (64, 64, 3)
    body = error.response.json()
    assert error.status_code == 429 and set(body) == {"error"}
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "rate_limit_error", "deadline_unattainable", None)
    assert "cannot meet its deadline" in body["error"]["message"]
    assert error.response.headers["retry-after"] == "1" and error.response.headers["x-request-id"]
    assert waited < SLO_S  # given up at once, not after waiting or running
    assert failed_requests(url) == failed + 1


def test_a_handle_caller_gets_the_same_error(patchedserve_app):
    _, handle = patchedserve_app
    with pytest.raises(APIError) as info:
        handle.generate.remote(DOOMED, "doomed-through-a-handle").result(timeout_s=60)
    assert (info.value.status, info.value.code, info.value.type) == (429, "deadline_unattainable", "rate_limit_error")
    assert handle.progress.remote("doomed-through-a-handle").result() is None  # nothing holds it any more


def test_the_served_analyzer_and_its_error_on_measured_batches_are_in_the_metrics(patchedserve_app):
    """tiny-sd-cpu measured 48 batches of tiny-sd at the policy's sizes, 12 of them packed forwards."""
    url, _ = patchedserve_app
    stats = {s.labels["stat"]: s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
             for s in family.samples if s.name == "stepserve_throughput_analyzer" and s.labels["model"] == "tiny-sd"}
    assert set(stats) == {"measured_samples", "filled_samples", "holdout_mean_rel_err", "holdout_max_rel_err"}
    assert stats["measured_samples"] == 38 and stats["filled_samples"] > 100
    assert 0 < stats["holdout_mean_rel_err"] <= stats["holdout_max_rel_err"]
