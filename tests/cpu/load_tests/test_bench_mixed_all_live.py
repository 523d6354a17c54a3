"""bench_mixed_all_live's pure parts: the mix (add-ons on images only, edits of the two templates,
videos), each request's SLO from its kind's solo latency sent in its body, the probes covering
every kind a run sends, attainment by class from records (a 429 is a miss), and the JSON and PNG.
No live app here (the bench itself runs one; tests/cpu/all_live serves the same mix for real)."""

import json

import pytest

from stepserve.load_tests.bench_mixed_all_live import (CLASSES, SOLO_MASK, attainment_by_class, build_report, kind_of,
                                                       parse_args, plot, probes, with_slos, workload)
from stepserve.load_tests.edit_workload import ScheduledEdit
from stepserve.load_tests.records import RequestRecord

ARGS = parse_args(["--out", "/unused"])


def test_the_mix_puts_addons_on_images_edits_on_the_templates_and_videos_apart():
    requests = workload(ARGS, 4.0, 0, duration_s=120.0)
    by_class = {c: [r for r in requests if r.request_class == c] for c in CLASSES}
    assert all(by_class.values()) and len(requests) == sum(map(len, by_class.values()))
    assert all(isinstance(r, ScheduledEdit) and r.template_id in ("template-0", "template-1") and r.model == "tiny-sd3"
               for r in by_class["edit"])
    assert {r.controlnets for r in by_class["image"]} == {(), ("canny",)}
    assert {r.loras for r in by_class["image"]} == {(), ("papercut",)}
    assert not any(r.controlnets or r.loras for r in by_class["edit"] + by_class["video"])
    assert all(r.is_video and r.model == "tiny-wan" for r in by_class["video"])
    assert [(r.seed, r.request_class) for r in workload(ARGS, 4.0, 0, duration_s=120.0)] == \
        [(r.seed, r.request_class) for r in requests]  # deterministic by seed


def test_probes_cover_every_kind_a_run_sends_and_every_template():
    kinds, templates = probes(ARGS, 1)
    assert {kind_of(r) for r in workload(ARGS, 4.0, 0, duration_s=300.0)} <= {kind_of(p) for p in kinds}
    assert sorted(t.template_id for t in templates) == ["template-0", "template-1"]
    assert all(p.mask_ratio == SOLO_MASK for p in kinds + templates if p.request_class == "edit")


def test_each_request_carries_its_scale_times_its_kinds_solo_latency_in_its_body():
    requests = workload(ARGS, 4.0, 0, duration_s=60.0)
    solo = {kind_of(r): 0.5 + 0.1 * len(r.controlnets) + 0.05 * r.width / 64 for r in requests}
    for r in with_slos(requests, solo, ARGS):
        scale = ARGS.video_slo if r.is_video else ARGS.image_slo
        assert r.slo_s == pytest.approx(scale * solo[kind_of(r)])
        assert r.body()["slo_s"] == r.slo_s


def record(index, request_class, latency, slo, status=200):
    return RequestRecord(index=index, steps=20, scheduled_s=0.0, sent_s=0.0, latency_s=latency, status=status,
                         slo_s=slo, request_class=request_class)


def test_attainment_by_class_counts_refusals_and_timeouts_as_misses(tmp_path):
    records = [record(0, "image", 1.0, 2.0), record(1, "image", None, 2.0, status=None),
               record(2, "edit", 0.5, 1.0), record(3, "edit", 0.1, 1.0, status=429), record(4, "video", 9.0, 8.0)]
    assert attainment_by_class(records) == {"image": 0.5, "edit": 0.5, "video": 0.0}
    setup = {"config_path": "configs/local-all.yaml", "image_slo": 5.0, "video_slo": 2.0}
    report = build_report(setup, {("image", 64, 64, (), ()): 0.4},
                          {"composed": {1.0: records, 2.0: records[:3]}, "genserve": {1.0: records, 2.0: records}})
    assert [(r["variant"], r["rate"]) for r in report["runs"]] == \
        [("composed", 1.0), ("composed", 2.0), ("genserve", 1.0), ("genserve", 2.0)]
    assert report["runs"][1]["slo_attainment_by_class"]["video"] is None
    path = tmp_path / "mixed_all_live.png"
    plot(json.loads(json.dumps(report)), path)
    assert path.stat().st_size > 10_000
