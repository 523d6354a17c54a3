"""A worker that encodes the prompts of what it admits (`text_encoder.on_workers`) runs exactly
what it runs when the text encoder deployment's embeddings come by reference; a prompt that
cannot be encoded fails only its own request, and a worker that does not encode prompts says so."""

import numpy as np

from stepserve.actors.denoiser import DenoiserWorker, worker_parts
from stepserve.actors.worker_options import WorkerPoolSpec
from stepserve.engine.families import DENOISER, TEXT, VAE
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import StepGroup, WorkerPlan
from stepserve.routing.core import AdmissionRef

from tests.tiny import TINY, TINY_FLUX, admission_for, make_spec

BAD = "a fox \ud800"  # a lone surrogate: the CLIP tokenizer raises on it (validation refuses it at the edge)


def test_a_worker_loads_the_text_encoders_only_when_it_encodes_prompts():
    assert worker_parts(TINY_FLUX) == {DENOISER}
    assert worker_parts(TINY_FLUX, encode_text=True) == {DENOISER, TEXT}
    assert worker_parts(TINY_FLUX, decode_images=True, encode_text=True) == {DENOISER, TEXT, VAE}
    assert worker_parts(TINY, encode_text=True) == {DENOISER, TEXT, VAE}  # (SD1.5 encodes edits' images)


def test_prompts_encoded_on_the_worker_give_the_text_encoders_images(tiny_family):
    worker = DenoiserWorker("w0", [TINY], WorkerPoolSpec(device="cpu", encode_text=True, text_cache_size=8))
    # CFG with a negative prompt, no CFG, and the same prompt again (a cache hit).
    specs = [make_spec("a", steps=2, seed=1, negative="blurry"), make_spec("b", steps=2, seed=2, guidance=1.0),
             make_spec("c", steps=2, seed=3, negative="blurry")]
    ids = tuple(s.request_id for s in specs)
    # Plan ids start at 1: a worker takes 0 as "never interrupted".
    plan = WorkerPlan("w0", admit=ids, groups=(StepGroup(ids),), steps=2, finish=ids, release=ids, plan_id=1)
    report, *latents = worker.execute(plan, tuple(AdmissionRef(s, None) for s in specs))

    # The reference: the same plan given the text encoder deployment's embeddings.
    reference = StepRunner("w0", {TINY.name: tiny_family})
    expected_report, expected = reference.execute(plan, {s.request_id: admission_for(tiny_family, s) for s in specs})
    assert report.failed == () and report.progress == expected_report.progress
    for got, want in zip(latents, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    # One batch: "a red fox" and "blurry" once each (CLIP's cache keys on the text).
    assert (worker.text.misses, worker.text.hits) == (2, 3)


def test_a_prompt_that_cannot_be_encoded_fails_only_its_request():
    worker = DenoiserWorker("w0", [TINY], WorkerPoolSpec(device="cpu", encode_text=True, text_cache_size=8))
    good, bad = make_spec("good", steps=1), make_spec("bad", steps=1, prompt=BAD)
    plan = WorkerPlan("w0", admit=("good", "bad"), groups=(StepGroup(("good", "bad")),), finish=("good", "bad"))
    report, good_latents, bad_latents = worker.execute(plan, (AdmissionRef(good, None), AdmissionRef(bad, None)))
    (failure,) = report.failed
    assert failure.request_id == "bad" and not failure.lost
    assert failure.message.startswith("text encoding failed: ")
    assert good_latents is not None and bad_latents is None


def test_a_worker_that_does_not_encode_prompts_fails_a_request_that_brings_none():
    worker = DenoiserWorker("w0", [TINY], WorkerPoolSpec(device="cpu"))
    spec = make_spec("a", steps=1)
    report = worker.execute(WorkerPlan("w0", admit=("a",)), (AdmissionRef(spec, None),))
    (failure,) = report.failed
    assert "does not encode prompts (text_encoder.on_workers is off)" in failure.message and not failure.lost
