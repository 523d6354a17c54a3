import dataclasses

import pytest

from stepserve.policies.cost_model import read_profile, resolve_profile, write_profile
from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.integration.conftest import serving


def gpu_like_profile(path):
    """tiny-wan-cpu.csv with its SP 2 denoise rows replaced by half the SP 1 time: what sequence
    parallelism buys a full-size model on GPUs, where compute dwarfs the all-to-alls. On this
    2-core box SP 2 is measured slower, so the real profile never lets GenServe pick it; this
    test double for the cost model (tested for real in tests/cpu/policies) makes it pick SP 2
    whenever workers are idle, to exercise live regrouping."""
    rows = read_profile(resolve_profile("tiny-wan-cpu"))
    sp1 = {(r.height, r.width, r.rows, r.frames): r for r in rows if r.component == "denoise" and r.sp_degree == 1}
    out = []
    for r in rows:
        if r.component == "denoise" and r.sp_degree == 2:
            r = dataclasses.replace(r, latency_ms=sp1[(r.height, r.width, r.rows, r.frames)].latency_ms / 2,
                             source="test double: SP 1 / 2")
        out.append(r)
    write_profile(path, out)
    return str(path)


@pytest.fixture(scope="package")
def elastic_app(tmp_path_factory):
    """configs/local-video.yaml with a cost model in which SP 2 pays, on a free port."""
    config = load_serve_config(CONFIGS / "local-video.yaml")
    router = config["applications"][0]["args"]["router"]
    router["profiles"] = ["tiny-sd-cpu", gpu_like_profile(tmp_path_factory.mktemp("profile") / "tiny-wan-gpu.csv")]
    # Without the composed policy's headroom: after the test's one image it keeps a worker free
    # from SP upgrades for up to `headroom_window_s` (60 s), so whether the video grew back before
    # its last step depended on how fast this host ran it (it did not on a fast day). Headroom has
    # its own tests (tests/cpu/policies/composed); here the mechanics of shrinking and growing.
    router["policy_options"] = {**router.get("policy_options", {}), "headroom_quantile": 0.0}
    for url, _ in serving(config):
        yield url
