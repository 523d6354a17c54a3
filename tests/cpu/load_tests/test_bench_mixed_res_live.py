"""bench_mixed_res_live's pure parts: each request's SLO from its size's measured solo latency, sent
in its body; the same requests at every rate; attainment and goodput from records (a 429 is a
miss); the JSON and PNG it writes. No live app here (the bench itself runs one)."""

import json

import pytest

from stepserve.load_tests.bench_mixed_res_live import (VARIANTS, MeasuredSolo, build_report, mix_spec, parse_args,
                                                       slo_requests, variant_config, write_outputs)
from stepserve.load_tests.records import RequestRecord
from stepserve.runtime import tiny_config_path, load_serve_config

SOLO = MeasuredSolo({64: 0.4, 96: 0.6, 128: 1.0})


def requests_at(rate, seed=0):
    return slo_requests(mix_spec("tiny-sd", [64, 96, 128], 20, 7.5, rate, seed, 5.0, duration_s=20.0), SOLO)


def test_each_request_carries_five_times_its_sizes_solo_latency_in_its_body():
    requests = requests_at(3.0)
    assert {r.width for r in requests} == {64, 96, 128}
    for r in requests:
        assert r.slo_s == pytest.approx(5.0 * SOLO.seconds[r.width])
        body = r.body()
        assert body["slo_s"] == r.slo_s and body["size"] == f"{r.width}x{r.width}"
        assert (body["num_inference_steps"], body["model"]) == (20, "tiny-sd")


def test_every_rate_sends_the_same_requests_closer_together():
    slow, fast = requests_at(1.0), requests_at(4.0)
    assert len(fast) > len(slow)
    same = [(r.width, r.seed, r.prompt, r.slo_s) for r in slow]
    assert [(r.width, r.seed, r.prompt, r.slo_s) for r in fast[:len(slow)]] == same
    assert fast[len(slow) - 1].offset_s < slow[-1].offset_s


def test_variants_differ_only_in_policy_and_packing():
    base = load_serve_config(tiny_config_path())
    configs = {v.label: variant_config(base, 8123, v, "tiny-sd-cpu", [64, 96, 128]) for v in VARIANTS}
    args = {label: c["applications"][0]["args"] for label, c in configs.items()}
    assert {label: (a["router"]["policy"], a["workers"]["pack_resolutions"]) for label, a in args.items()} == {
        "static_fcfs": ("static_fcfs", False), "continuous": ("continuous", False),
        "continuous_packed": ("continuous", True), "patchedserve": ("patchedserve", False),
        "patchedserve_packed": ("patchedserve", True)}
    assert args["patchedserve_packed"]["router"]["policy_options"] == {"sizes": [[64, 64], [96, 96], [128, 128]]}
    assert args["continuous"]["router"]["policy_options"] == {}
    assert all(a["router"]["profiles"] == ["tiny-sd-cpu"] for a in args.values())
    assert all(c["http_options"]["port"] == 8123 for c in configs.values())
    assert base["applications"][0]["args"]["router"]["policy"] == "continuous"  # the base is left alone


def test_unknown_variants_and_bad_sizes_are_refused():
    assert [v.label for v in parse_args(["--out", "x", "--variants", "continuous,static_fcfs"]).variants] == [
        "continuous", "static_fcfs"]
    for argv in (["--variants", "fifo"], ["--sizes", "64,64"], ["--sizes", "big"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *argv])


def record(index, width, latency, status=200, slo=1.0, scheduled=0.0):
    return RequestRecord(index=index, steps=20, scheduled_s=scheduled, sent_s=scheduled,
                         latency_s=latency if status == 200 else None, status=status, slo_s=slo, width=width,
                         height=width)


def fake_records():
    """static_fcfs meets 100% at 1 req/s and 50% at 2; patchedserve 100% and 90% (its one miss
    a 429: it gave the request up)."""
    def run(misses, refused=0):
        out = [record(i, 64 if i % 2 else 128, 0.5, scheduled=i * 0.1) for i in range(10 - misses - refused)]
        out += [record(20 + i, 128, 3.0, scheduled=1.0) for i in range(misses)]
        out += [record(40 + i, 96, None, status=429, scheduled=1.0) for i in range(refused)]
        return out
    return {"static_fcfs": {1.0: run(0), 2.0: run(5)}, "patchedserve_packed": {1.0: run(0), 2.0: run(0, refused=1)}}


def test_attainment_counts_refusals_as_misses_and_goodput_is_the_sims():
    report = build_report({"slo_scale": 5.0}, {64: 0.2, 128: 0.3}, fake_records())
    attainment = {(run["variant"], run["rate"]): run["summary"]["slo_attainment"] for run in report["runs"]}
    assert attainment == {("static_fcfs", 1.0): 1.0, ("static_fcfs", 2.0): 0.5,
                          ("patchedserve_packed", 1.0): 1.0, ("patchedserve_packed", 2.0): 0.9}
    good = report["goodput_at_90"]
    # static: 1.0 meets 90%, 2.0 does not; linear between (1.0 - 0.9) / (1.0 - 0.5) of the way
    assert good["static_fcfs"] == {"rps": pytest.approx(1.2), "at_least": False, "vs_static": pytest.approx(1.0)}
    assert good["patchedserve_packed"] == {"rps": 2.0, "at_least": True, "vs_static": pytest.approx(2.0 / 1.2)}
    assert report["slo_s"] == {"64": pytest.approx(1.0), "128": pytest.approx(1.5)}
    refused = next(r for r in report["runs"] if r["variant"] == "patchedserve_packed" and r["rate"] == 2.0)
    assert refused["by_size"]["96"]["slo_attainment"] == 0.0 and refused["by_size"]["64"]["slo_attainment"] == 1.0


def test_writes_the_json_and_png(tmp_path):
    report = build_report({"slo_scale": 5.0}, {64: 0.2}, fake_records())
    json_path, png_path = write_outputs(tmp_path / "out", report, "fake")
    written = json.loads(json_path.read_text())
    assert written["goodput_at_90"]["patchedserve_packed"]["at_least"] is True
    assert len(written["runs"]) == 4 and len(written["runs"][0]["records"]) == 10
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png_path.stat().st_size > 10_000
