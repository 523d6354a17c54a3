"""The step runner executes one plan: its ops in order, a payload per output, failures confined
to their own requests (and saying whether the state was lost), images and videos side by side."""

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from stepserve.actors.denoiser import worker_parts
from stepserve.engine.families import ALL_PARTS, DENOISER, VAE, load_family
from stepserve.engine.png import encode_png
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.policies.types import RequestFailure, RequestProgress, StepGroup, WorkerPlan

from tests.tiny import TINY_FLUX, admission_for, make_spec, solo_pipeline_image
from tests.tiny_video import TINY_WAN, make_video_spec, run_video, solo_pipeline_video

ATOL = 2e-5  # as test_golden


@pytest.fixture(scope="module")
def wan():
    return load_family(TINY_WAN, ALL_PARTS, "cpu")


def runner(*families, worker_id="w0"):
    return StepRunner(worker_id, {f.source.name: f for f in families}, incarnation="inc-1")


def group(*ids, ranks=()):
    return StepGroup(tuple(ids), ranks)


def failures(report) -> dict[str, bool]:
    return {f.request_id: f.lost for f in report.failed}


def admissions_for(specs, image_family, video_family) -> dict[str, Admission]:
    return {s.request_id: admission_for(video_family if s.is_video else image_family, s) for s in specs}


def test_the_report_describes_the_plan(tiny_family):
    r = runner(tiny_family, worker_id="w7")
    specs = [make_spec("a", steps=3), make_spec("b", steps=2, guidance=1.0)]
    plan = WorkerPlan("w7", admit=("a", "b"), groups=(group("a", "b"),), plan_id=41)
    report, payloads = r.execute(plan, {s.request_id: admission_for(tiny_family, s) for s in specs})
    assert payloads == []
    assert (report.worker_id, report.plan_id, report.incarnation, report.batch_size) == ("w7", 41, "inc-1", 2)
    assert report.progress == (RequestProgress("a", 1, 3), RequestProgress("b", 1, 2)) and report.failed == ()
    assert report.duration_s > 0 and r.resident == ("a", "b")
    # Admitted without a step: at step 0.
    report, _ = r.execute(WorkerPlan("w7", admit=("c",)), {"c": admission_for(tiny_family, make_spec("c"))})
    assert report.progress == (RequestProgress("c", 0, 6),) and report.batch_size == 0


def test_ops_run_in_order(tiny_family):
    r = runner(tiny_family)
    a, b = make_spec("a", steps=4, seed=1), make_spec("b", steps=4, seed=2)
    admissions = {"a": admission_for(tiny_family, a), "b": admission_for(tiny_family, b)}
    # Groups before export and checkpoint: both states are one step in.
    plan = WorkerPlan("w0", admit=("a", "b"), groups=(group("a"), group("b")), export=("b",), checkpoint=("a",))
    report, (b_state, a_state) = r.execute(plan, admissions)
    assert (b_state["spec"], b_state["step_index"], a_state["spec"], a_state["step_index"]) == (b, 1, a, 1)
    assert r.resident == ("a",)  # exported leaves, checkpointed stays
    # Drop before admit: "a" starts over instead of being refused as already resident. Checkpoint
    # before release: the copy is taken, then the request is forgotten.
    plan = WorkerPlan("w0", drop=("a",), admit=("a",), groups=(group("a"),), checkpoint=("a",), release=("a",))
    report, (state,) = r.execute(plan, {"a": admissions["a"]})
    assert report.failed == () and report.progress == (RequestProgress("a", 1, 4),)
    assert state["step_index"] == 1 and r.resident == ()
    assert torch.equal(state["latents"], a_state["latents"])  # the same first step again
    # Finish before release: a request finished and released in one plan returns its output.
    one = make_spec("one", steps=1)
    plan = WorkerPlan("w0", admit=("one",), groups=(group("one"),), finish=("one",), release=("one",))
    report, (latents,) = r.execute(plan, {"one": admission_for(tiny_family, one)})
    assert report.failed == () and latents.shape == (1, 4, 8, 8) and r.resident == ()


def test_a_plan_of_several_steps_equals_as_many_plans_of_one(tiny_family):
    specs = [make_spec("a", steps=5, seed=1), make_spec("b", steps=3, seed=2)]
    admissions = {s.request_id: admission_for(tiny_family, s) for s in specs}
    one_by_one, at_once = runner(tiny_family), runner(tiny_family)
    one_by_one.execute(WorkerPlan("w0", admit=("a", "b")), admissions)
    for _ in range(2):
        one_by_one.execute(WorkerPlan("w0", groups=(group("a", "b"),)), {})
    _, (b_alone,) = one_by_one.execute(WorkerPlan("w0", groups=(group("a", "b"),), finish=("b",)), {})
    report, (b_at_once,) = at_once.execute(
        WorkerPlan("w0", admit=("a", "b"), groups=(group("a", "b"),), finish=("b",), steps=3), admissions)
    assert report.progress == (RequestProgress("a", 3, 5), RequestProgress("b", 3, 3)) and report.batch_size == 2
    np.testing.assert_array_equal(b_at_once, b_alone)
    torch.testing.assert_close(at_once.samplers["a"].latents, one_by_one.samplers["a"].latents, rtol=0, atol=0)
    # Finishing is checked against the steps the plan really ran.
    report, _ = at_once.execute(WorkerPlan("w0", groups=(group("a"),), finish=("a",), steps=1), {})
    assert failures(report) == {"a": False} and "steps are left" in report.failed[0].message


def test_a_plan_cut_short_keeps_what_it_was_to_finish_and_resumes_exactly(tiny_family):
    specs = [make_spec("a", steps=6, seed=1), make_spec("b", steps=4, seed=2)]
    admissions = {s.request_id: admission_for(tiny_family, s) for s in specs}
    whole, cut = runner(tiny_family), runner(tiny_family)
    asked = []

    def stop_after_two():  # asked before every step but the first
        asked.append(len(asked))
        return len(asked) == 2

    plan = WorkerPlan("w0", admit=("a", "b"), groups=(group("a", "b"),), checkpoint=("a",), finish=("b",), steps=4,
                      plan_id=9)
    report, (a_state, b_out) = cut.execute(plan, admissions, stop=stop_after_two)
    assert report.steps_run == 2 and report.failed == () and report.batch_size == 2
    assert report.progress == (RequestProgress("a", 2, 6), RequestProgress("b", 2, 4))
    assert b_out is None and cut.resident == ("a", "b")  # "b" is not done: it stays, unfinished
    assert a_state["step_index"] == 2  # the checkpoint holds the steps that ran
    # The rest, in another plan, gives what one uncut plan gives, bit for bit.
    _, (b_cut,) = cut.execute(WorkerPlan("w0", groups=(group("a", "b"),), finish=("b",), steps=2), {})
    report, (_, b_whole) = whole.execute(plan, admissions, stop=lambda: False)
    assert report.steps_run is None
    np.testing.assert_array_equal(b_cut, b_whole)
    torch.testing.assert_close(cut.samplers["a"].latents, whole.samplers["a"].latents, rtol=0, atol=0)
    # A stop asked for on a one-step plan changes nothing: the first step always runs.
    report, _ = cut.execute(WorkerPlan("w0", groups=(group("a"),)), {}, stop=lambda: True)
    assert report.steps_run is None and report.progress == (RequestProgress("a", 5, 6),)


def test_payloads_follow_plan_outputs_and_a_checkpoint_resumes_exactly(tiny_family):
    r = runner(tiny_family)
    specs = {rid: make_spec(rid, steps=n, seed=seed) for rid, n, seed in (("a", 1, 1), ("b", 3, 2), ("c", 3, 3))}
    plan = WorkerPlan("w0", admit=tuple(specs), groups=(group(*specs),), export=("b",), checkpoint=("c",),
                      finish=("a",))
    assert plan.outputs == ("b", "c", "a")
    report, payloads = r.execute(plan, {rid: admission_for(tiny_family, s) for rid, s in specs.items()})
    assert report.failed == () and len(payloads) == 3
    exported, checkpoint, latents = payloads
    assert exported["spec"] == specs["b"] and checkpoint["spec"] == specs["c"]
    tensors = (exported["latents"], checkpoint["latents"], checkpoint["cond"]["context"])
    assert all(t.device.type == "cpu" for t in tensors)
    assert isinstance(latents, np.ndarray) and latents.dtype == np.float32 and latents.shape == (1, 4, 8, 8)
    assert report.progress == tuple(RequestProgress(rid, 1, s.num_inference_steps) for rid, s in specs.items())
    assert r.resident == ("c",)

    # "c" goes on here; its checkpoint, resumed on another worker, ends the same way.
    other = runner(tiny_family, worker_id="w1")
    resume = Admission(specs["c"], state=pickle.loads(pickle.dumps(checkpoint)))
    other.execute(WorkerPlan("w1", admit=("c",)), {"c": resume})
    ends = []
    for worker in (r, other):
        worker.execute(WorkerPlan(worker.worker_id, groups=(group("c"),)), {})
        _, (end,) = worker.execute(WorkerPlan(worker.worker_id, groups=(group("c"),), finish=("c",)), {})
        ends.append(end)
    np.testing.assert_array_equal(ends[0], ends[1])
    assert not np.array_equal(ends[0], latents)  # the comparison can fail: different requests differ


def test_failures_are_confined_to_their_requests(tiny_family):
    r = runner(tiny_family)
    r.execute(WorkerPlan("w0", admit=("ok",)), {"ok": admission_for(tiny_family, make_spec("ok", steps=5))})
    cfg = make_spec("no-negative", guidance=7.5)
    narrow = make_spec("narrow")  # embeddings the UNet cannot attend to: its forward raises
    admissions = {
        "fresh": admission_for(tiny_family, make_spec("fresh", steps=5)),
        "no-negative": Admission(cfg, Conditioning(admission_for(tiny_family, cfg).conditioning.prompt)),
        "other-model": admission_for(tiny_family, dataclasses.replace(make_spec("other-model"), model="big-sd")),
        "narrow": Admission(narrow, Conditioning({"context": torch.zeros(1, 77, 8)},
                                                 {"context": torch.zeros(1, 77, 8)})),
        "mislabeled": admission_for(tiny_family, make_spec("someone-else")),
        "both": Admission(make_spec("both"), admission_for(tiny_family, make_spec("both")).conditioning,
                          state={"format": 2}),
    }
    plan = WorkerPlan(
        "w0", admit=("fresh", "no-negative", "other-model", "narrow", "missing", "mislabeled", "both"),
        groups=(group("ok", "gone", "fresh", "no-negative"), group("narrow")),
        export=("away",), checkpoint=("fresh",), finish=("ok",),
    )
    report, payloads = r.execute(plan, admissions)
    assert failures(report) == {
        "no-negative": False, "other-model": False, "missing": False, "mislabeled": False, "both": False,
        "gone": True,  # stepped but not resident: its state was lost (e.g. the worker restarted)
        "narrow": False,  # its forward raised
        "away": True,  # exported but not resident
        "ok": False,  # finished with steps left
    }
    messages = {f.request_id: f.message for f in report.failed}
    assert "CFG needs negative prompt embeddings" in messages["no-negative"]
    assert "'big-sd' is not loaded on worker w0" in messages["other-model"]
    assert "no admission was given" in messages["missing"]
    assert "the admission is for request someone-else" in messages["mislabeled"]
    assert "either conditioning or a state" in messages["both"]
    assert "gone is not resident on worker w0" in messages["gone"]
    assert messages["narrow"].startswith("denoising step failed: RuntimeError")
    assert "4 of its 5 steps are left" in messages["ok"]
    assert all(m.startswith("admission failed") for rid, m in messages.items()
               if rid in ("no-negative", "other-model", "missing", "mislabeled", "both"))
    # Everyone else went on: "fresh" stepped in the group the missing and failing members were
    # in, and its checkpoint came back; the failed ones are forgotten.
    assert report.progress == (RequestProgress("fresh", 1, 5),) and report.batch_size == 5
    assert payloads[0] is None and payloads[1]["step_index"] == 1 and payloads[2] is None
    assert r.resident == ("fresh",)
    # A request admitted twice is refused (and forgotten, as every failed request is).
    report, _ = r.execute(WorkerPlan("w0", admit=("fresh",)), {"fresh": admissions["fresh"]})
    assert failures(report) == {"fresh": False} and "already resident" in report.failed[0].message
    assert r.resident == ()


def test_finishing_an_unfinished_request_fails_it(tiny_family, wan):
    r = runner(tiny_family, wan)
    specs = [make_spec("image", steps=2), make_video_spec("video", steps=2)]
    plan = WorkerPlan("w0", admit=("image", "video"), groups=(group("image"), group("video")),
                      finish=("image", "video"))
    report, payloads = r.execute(plan, admissions_for(specs, tiny_family, wan))
    assert payloads == [None, None] and r.resident == ()
    assert report.failed == tuple(RequestFailure(rid, "finish failed: ValueError: 1 of its 2 steps are left; only a "
                                                      "fully denoised request finishes", lost=False)
                                  for rid in ("image", "video"))


def test_images_and_a_video_in_one_plan(tiny_family, wan):
    r = runner(tiny_family, wan)
    specs = [make_spec("i1", steps=3, seed=4, negative="blurry"), make_spec("i2", steps=3, seed=5, guidance=1.0),
             make_video_spec("v", steps=3, seed=6, negative="static")]
    ids = tuple(s.request_id for s in specs)
    admissions = admissions_for(specs, tiny_family, wan)
    groups = (group("i1", "i2"), group("v"))
    r.execute(WorkerPlan("w0", admit=ids, groups=groups), admissions)
    r.execute(WorkerPlan("w0", groups=groups), {})
    report, outputs = r.execute(WorkerPlan("w0", groups=groups, finish=ids), {})
    assert report.failed == () and report.batch_size == 3 and r.resident == ()
    assert report.progress == tuple(RequestProgress(rid, 3, 3) for rid in ids)  # finished: all steps
    done = dict(zip(ids, outputs))
    for spec in specs[:2]:
        image = tiny_family.decode(torch.from_numpy(done[spec.request_id]))[0]
        np.testing.assert_allclose(image, solo_pipeline_image(tiny_family, spec), atol=ATOL)
    frames = done["v"]
    assert frames.shape == (5, 64, 64, 3) and frames.dtype == np.uint8
    # Decoded on the worker exactly as the video's own sampler and family decode it ...
    alone = run_video(wan, specs[2], admissions["v"].conditioning).latents
    np.testing.assert_array_equal(frames, (wan.decode(alone)[0] * 255).round().astype(np.uint8))
    # ... which is WanPipeline's video, up to one level of rounding.
    expected = (solo_pipeline_video(wan, specs[2])[0] * 255).round().astype(np.uint8)
    assert np.abs(frames.astype(int) - expected.astype(int)).max() <= 1


def test_a_worker_that_decodes_images_returns_the_decoder_deployments_png(tiny_family, wan):
    specs = [make_spec("a", steps=2, seed=7), make_spec("b", steps=3, seed=8, negative="blurry"),
             make_video_spec("v", steps=2, seed=9)]
    ids = tuple(s.request_id for s in specs)
    admissions = admissions_for(specs, tiny_family, wan)
    groups = (group("a", "b"), group("v"))
    outputs = {}
    for decode_images in (False, True):
        r = StepRunner("w0", {f.source.name: f for f in (tiny_family, wan)}, decode_images=decode_images)
        r.execute(WorkerPlan("w0", admit=ids, groups=groups), admissions)
        r.execute(WorkerPlan("w0", groups=(group("a", "b"), group("v")), finish=("a", "v")), {})
        report, finished = r.execute(WorkerPlan("w0", groups=(group("b"),), finish=("b",)), {})
        assert report.failed == () and r.resident == ()
        outputs[decode_images] = finished
    latents, png = outputs[False][0], outputs[True][0]
    assert isinstance(png, bytes) and latents.dtype == np.float32
    # Byte for byte what the VAE decoder deployment makes of the latents the other runner returned.
    assert png == encode_png(tiny_family.decode(torch.from_numpy(latents))[0])


def test_a_worker_loads_an_image_models_vae_when_it_decodes_or_edits_images(tiny_family, wan):
    flux = TINY_FLUX  # (a family that does not edit)
    assert worker_parts(flux) == {DENOISER}
    assert worker_parts(flux, decode_images=True) == {DENOISER, VAE}
    assert worker_parts(tiny_family.source) == {DENOISER, VAE}  # it encodes the images of edits
    assert worker_parts(wan.source) == {DENOISER, VAE}  # a video always decodes where it was denoised
    r = StepRunner("w0", {"tiny-sd": load_family(tiny_family.source, {DENOISER}, "cpu")}, decode_images=True)
    spec = make_spec("a", steps=1)
    report, (png,) = r.execute(WorkerPlan("w0", admit=("a",), groups=(group("a"),), finish=("a",)),
                               {"a": admission_for(tiny_family, spec)})
    assert png is None and failures(report) == {"a": False} and "no VAE loaded" in report.failed[0].message


def test_a_video_paused_and_resumed_elsewhere_equals_uninterrupted(wan):
    spec = make_video_spec("job", steps=4, seed=21, guidance=5.0, frames=5, negative="blurry")
    admission = admission_for(wan, spec)
    uninterrupted = run_video(wan, spec, admission.conditioning).latents
    first, second = runner(wan), runner(load_family(TINY_WAN, {DENOISER}, "cpu"), worker_id="w1")
    step = (group("job"),)
    first.execute(WorkerPlan("w0", admit=("job",), groups=step), {"job": admission})
    _, (state,) = first.execute(WorkerPlan("w0", groups=step, export=("job",)), {})
    assert first.resident == () and state["step_index"] == 2
    history = state["scheduler"]["attrs"]["model_outputs"]
    assert any(h is not None for h in history)  # UniPC's multistep history travels with it
    resume = {"job": Admission(spec, state=pickle.loads(pickle.dumps(state)))}  # as it crosses processes
    report, _ = second.execute(WorkerPlan("w1", admit=("job",), groups=step), resume)
    assert report.progress == (RequestProgress("job", 3, 4),)
    report, (final,) = second.execute(WorkerPlan("w1", groups=step, checkpoint=("job",)), {})
    assert report.progress == (RequestProgress("job", 4, 4),)
    assert torch.equal(final["latents"], uninterrupted)
    # This worker loaded no VAE, so it cannot decode the video it holds.
    report, (frames,) = second.execute(WorkerPlan("w1", finish=("job",)), {})
    assert frames is None and failures(report) == {"job": False} and "no VAE loaded" in report.failed[0].message


def test_sequence_parallel_groups(tiny_family, wan):
    spec = make_video_spec("v", steps=2, seed=8)
    asked = []

    def dead_partner(ranks):
        asked.append(ranks)
        raise RuntimeError("rank 1 never came")

    r = runner(tiny_family, wan)
    r.execute(WorkerPlan("w0", admit=("v",)), {"v": admission_for(wan, spec)})
    # A group of one rank runs here alone, whatever the process-group lookup says for it.
    report, _ = r.execute(WorkerPlan("w0", groups=(group("v", ranks=(0,)),)), {}, sp_group=lambda ranks: None)
    assert report.failed == () and report.progress == (RequestProgress("v", 1, 2),)
    # A partner gone: the step fails and the state counts as lost (resume from a checkpoint).
    report, _ = r.execute(WorkerPlan("w0", groups=(group("v", ranks=(0, 1)),)), {}, sp_group=dead_partner)
    assert asked == [(0, 1)] and failures(report) == {"v": True} and "rank 1 never came" in report.failed[0].message
    assert r.resident == ()
    # Groups that cannot run sequence-parallel are refused before any collective.
    images = {rid: admission_for(tiny_family, make_spec(rid)) for rid in ("i", "j")}
    r.execute(WorkerPlan("w0", admit=("i", "j", "v")), {**images, "v": admission_for(wan, spec)})
    plan = WorkerPlan("w0", groups=(group("i", ranks=(0, 1)), group("v", ranks=(0, 1))))
    report, _ = r.execute(plan, {})  # no process groups on this worker
    assert failures(report) == {"i": False, "v": False}
    messages = [f.message for f in report.failed]
    assert "'tiny-sd' cannot run sequence-parallel" in messages[0] and "has no process groups" in messages[1]
    r.execute(WorkerPlan("w0", admit=("v",)), {"v": admission_for(wan, spec)})
    report, _ = r.execute(WorkerPlan("w0", groups=(group("j", "v", ranks=(0, 1)),)), {}, sp_group=dead_partner)
    assert failures(report) == {"j": False, "v": False} and "cannot mix models" in report.failed[0].message
    assert len(asked) == 1  # never asked for a group it would not run
