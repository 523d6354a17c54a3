"""The Grafana dashboard in the repo (`k8s/grafana/stepserve-dashboard.json`) asks only for
metrics the app exports: the router's registry and an ingress replica's, by the sample names
Prometheus sees (a counter's `_total`, a histogram's `_bucket`, `_sum` and `_count`)."""

import json
import re
from pathlib import Path

from stepserve.actors.metrics import RouterMetrics
from stepserve.deployments.ingress import HTTPMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "stepserve-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> set[str]:
    names = set()
    for registry in (RouterMetrics().registry, HTTPMetrics(router=None).registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def test_every_panel_asks_for_metrics_the_app_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    names = exported()
    asked = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\bstepserve_[a-z_]+", target["expr"]))
            assert used, (panel["title"], target["expr"])
            assert used <= names, (panel["title"], sorted(used - names))
            asked |= used
    # The must-haves are on it: SLO attainment and goodput, per-step latency, queued steps.
    assert {"stepserve_slo_requests_total", "stepserve_step_latency_seconds_bucket",
            "stepserve_queued_steps", "stepserve_http_requests_total"} <= asked


def test_the_dashboard_is_importable():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "stepserve" and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (variable,) = dashboard["templating"]["list"]  # the Prometheus data source, picked on import
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in dashboard["panels"])
