"""The text encoder isolates failures: a bad item fails its own caller, never its batch-mates."""

import time

import numpy as np
import pytest

from stepserve.deployments.text_encoder import TextEncoder
from stepserve.engine.families import TEXT, ModelSource, load_family
from stepserve.engine.text_encoding import encode_items

TINY = ModelSource(name="tiny-sd", family="sd15", preset="tiny")
# A lone surrogate: validation refuses it at the ingress, so only a direct caller can send it,
# and the CLIP tokenizer raises on it (it cannot be encoded as UTF-8).
BAD = "a fox \ud800"
FOX = ("tiny-sd", "a red fox", "blurry")
CAT = ("tiny-sd", "a cat", None)


@pytest.fixture(scope="module")
def family():
    """The same seeded weights, loaded apart from the encoder under test."""
    return load_family(TINY, {TEXT}, "cpu")


@pytest.fixture(scope="module")
def reference(family):
    """What each text encodes to on its own."""
    return lambda text: family.encode_text([text])["context"].float().numpy()


@pytest.fixture(scope="module")
def bad_error(family) -> type[Exception]:
    """What the tokenizer raises for BAD (its type depends on the tokenizer implementation)."""
    with pytest.raises(Exception) as info:
        family.encode_text([BAD])
    return info.type


def assert_embeddings(result, item, reference):
    _, prompt, negative = item
    cond, uncond = result
    np.testing.assert_allclose(cond["context"], reference(prompt), rtol=1e-5, atol=1e-5)
    if negative is None:
        assert uncond is None
    else:
        np.testing.assert_allclose(uncond["context"], reference(negative), rtol=1e-5, atol=1e-5)


def counting_calls(encoder: TextEncoder, monkeypatch) -> list[list[str]]:
    """The texts of each call into the model family, to see how items were batched."""
    family = encoder.encoder.families["tiny-sd"]
    calls, encode_text = [], family.encode_text
    monkeypatch.setattr(family, "encode_text", lambda texts: calls.append(list(texts)) or encode_text(texts))
    return calls


def test_a_clean_batch_is_one_call(reference, monkeypatch):
    encoder = TextEncoder([TINY], device="cpu")
    calls = counting_calls(encoder, monkeypatch)
    fox, cat = encode_items(encoder.encoder, [FOX, CAT])
    assert calls == [["a red fox", "a cat", "blurry"]]
    assert_embeddings(fox, FOX, reference)
    assert_embeddings(cat, CAT, reference)


def test_bad_items_fail_alone(reference, bad_error, monkeypatch):
    encoder = TextEncoder([TINY], device="cpu")
    calls = counting_calls(encoder, monkeypatch)
    items = [FOX, ("tiny-sd", BAD, None), CAT, ("tiny-sd", "a dog", BAD), ("no-such-model", "a cat", None)]
    fox, bad_prompt, cat, bad_negative, unknown = encode_items(encoder.encoder, items)

    assert type(bad_prompt) is bad_error and type(bad_negative) is bad_error
    assert bad_prompt is not bad_negative  # each caller raises its own exception
    assert bad_prompt.__context__ is None  # and not the failed batch's, which others shared
    assert isinstance(unknown, ValueError) and "no-such-model" in str(unknown)
    assert_embeddings(fox, FOX, reference)
    assert_embeddings(cat, CAT, reference)
    # The batch was tried once (repeated texts once), then each item alone, its texts in one call.
    assert calls[0] == ["a red fox", BAD, "a cat", "a dog", "blurry"]
    assert calls[1:] == [["a red fox", "blurry"], [BAD], ["a cat"], ["a dog", BAD]]
    # The good texts are cached as usual: asking again encodes nothing.
    calls.clear()
    assert_embeddings(encode_items(encoder.encoder, [FOX])[0], FOX, reference)
    assert calls == []


@pytest.fixture(scope="module")
def served():
    """The deployment on a local Ray: serve.batch needs a replica context, which neither a bare
    asyncio loop nor Serve's `_local_testing_mode` provides (Ray 2.60)."""
    import ray
    from ray import serve

    from stepserve.runtime import start_local_ray

    start_local_ray(num_cpus=2)
    serve.start(proxy_location="Disabled")
    # Batches of 3 that wait up to 30 s to fill: three concurrent calls share one batch.
    app = serve.deployment(TextEncoder).bind([TINY], device="cpu", max_batch_size=3, batch_wait_timeout_s=30.0)
    try:
        yield serve.run(app, name="text-encoder-test", route_prefix=None)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_through_serve_only_the_bad_caller_fails(served, reference, bad_error):
    assert served.ready.remote().result(timeout_s=60) is True
    start = time.monotonic()
    fox, bad, cat = (served.encode.remote(*item) for item in (FOX, ("tiny-sd", BAD, None), CAT))
    assert_embeddings(fox.result(timeout_s=60), FOX, reference)
    assert_embeddings(cat.result(timeout_s=60), CAT, reference)
    with pytest.raises(bad_error):  # Ray's RayTaskError subclasses the replica's exception type
        bad.result(timeout_s=60)
    # Long before the 30 s batch window: the three calls filled one batch.
    assert time.monotonic() - start < 20
