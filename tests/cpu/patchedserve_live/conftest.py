import pytest

from stepserve.runtime import tiny_config_path, load_serve_config

from tests.cpu.integration.conftest import serving

SLO_S = 5.0  # tiny-sd's latency objective here


@pytest.fixture(scope="package")
def patchedserve_app():
    """configs/local-tiny.yaml (tiny-sd, 2 CPU workers) under the PatchedServe policy, its requests
    held to a 5 s SLO and priced by this machine's CPU profile (tiny-sd-cpu), served by a real
    local Ray + Serve. Its own package: the other apps' Ray is gone by now."""
    config = load_serve_config(tiny_config_path())
    args = config["applications"][0]["args"]
    args["models"][0]["slo_s"] = SLO_S
    args["router"].update(policy="patchedserve", profiles=["tiny-sd-cpu"],
                          policy_options={"sizes": [[64, 64], [128, 128], [256, 256]]})  # the profile's sizes
    yield from serving(config)
