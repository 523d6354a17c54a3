"""`edit_cache` live: a real local Ray + Serve app whose workers record a template's activations
in the node's activation store on its first edit and reuse them for the next (over HTTP, as the
openai client sends edits), while edits without a template stay exact."""

import base64
import io

import httpx
import numpy as np
import openai
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from stepserve.load_tests.bench_edit_cache import cache_stats
from tests.cpu.deployments.test_edits_api import mask_png
from tests.cpu.integration.conftest import serving

CONFIG = {
    "proxy_location": "HeadOnly",
    "applications": [{"name": "stepserve", "route_prefix": "/", "import_path": "stepserve.deployments.app:build_app",
                      "args": {
                          "models": [{"name": "tiny-sd3", "family": "sd3", "preset": "tiny", "default_size": "64x64",
                                      "max_size": 256, "default_steps": 4}],
                          "workers": {"num_workers": 1, "max_batch_size": 4, "num_cpus": 0.5, "device": "cpu",
                                      "torch_threads": 1},
                          "text_encoder": {"on_workers": True}, "vae_decoder": {"on_workers": True},
                          "ingress": {"num_cpus": 0.1},
                          # (each worker keeps no record of its own: every edit asks the store)
                          "edit_cache": {"enabled": True, "memory_bytes": 64 << 20, "worker_bytes": 0},
                      }}],
}


@pytest.fixture(scope="module")
def app():
    yield from serving(CONFIG)


def store_stats(url: str) -> dict[str, float]:
    return cache_stats(httpx.get(f"{url}/metrics", timeout=30).text)


def edit_blocks(url: str) -> dict[str, float]:
    """`stepserve_edit_blocks` by how, and the unplanned forwards."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == "stepserve_edit_blocks_total":
                out[sample.labels["how"]] = sample.value
            elif sample.name == "stepserve_edit_unplanned_forwards_total":
                out["unplanned"] = sample.value
    return out


def test_a_template_is_recorded_once_and_reused(app):
    url, _ = app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(picture, "PNG")

    def edit(seed: int, template: str | None, box=(16, 16, 48, 48)) -> np.ndarray:
        extra = {"seed": seed, **({"template_id": template} if template else {})}
        result = client.images.edit(image=("t.png", picture.getvalue(), "image/png"), prompt="a cat",
                                    mask=("m.png", mask_png(box=box), "image/png"), extra_body=extra)
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json))).convert("RGB"))

    first = edit(1, "sofa")  # records (exact)
    assert np.array_equal(first, edit(1, None))
    before = store_stats(url)
    assert before["memory_values"] == 1 and before["misses"] == 1 and before["memory_hits"] == 0
    reused = edit(2, "sofa", box=(16, 16, 32, 32))  # reuses the record: another seed and mask
    after = store_stats(url)
    assert after["memory_hits"] == 1 and after["memory_values"] == 1
    # Its 4 masked forwards loaded the whole keys-values record (2 blocks and the final tokens) each.
    assert edit_blocks(url) == {"loaded": 4 * 3, "computed": 0, "unplanned": 0}
    exact = edit(2, None, box=(16, 16, 32, 32))
    assert reused.shape == exact.shape and np.abs(reused.astype(int) - exact.astype(int)).mean() < 8
    # Another image under the same name is another template: recorded anew, exact.
    first_picture = picture.getvalue()
    picture.seek(0)
    picture.truncate()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(picture, "PNG")
    assert picture.getvalue() != first_picture
    assert np.array_equal(edit(1, "sofa"), edit(1, None))
    assert store_stats(url)["memory_values"] == 2
