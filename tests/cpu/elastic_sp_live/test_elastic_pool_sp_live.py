"""An elastic pool whose videos run over several workers (configs/local-video.yaml, SP 2 priced to
pay): it grows from one worker to two under two videos, and the workers' process-group world is
built again with both, so the next video runs at SP 2; the pool does not shrink while that video
holds both workers, shrinks once it is done (a world of one again), and the next video still runs.
Each video equals the same video run alone, whatever degrees it ran at."""

import time

import httpx
import numpy as np
from ray import serve

from stepserve.runtime import CONFIGS, load_serve_config

from tests.cpu.coserve_live.test_coserve_live import VIDEO, job_record, poll, reference_frames, unzip_frames, wait_until
from tests.cpu.coserve_sp_live.conftest import gpu_like_profile
from tests.cpu.integration.conftest import serving

STEPS = {"a": 100, "b": 100, "c": 40, "d": 40}
SEEDS = {"a": 1, "b": 2, "c": 3, "d": 4}


def pool_state():
    return serve.get_deployment_handle("Router", app_name="stepserve").readiness.remote().result()


def test_the_world_follows_the_pool_as_it_grows_and_shrinks(tmp_path):
    config = load_serve_config(CONFIGS / "local-video.yaml")
    args = config["applications"][0]["args"]
    args["router"]["profiles"] = ["tiny-sd-cpu", gpu_like_profile(tmp_path / "tiny-wan-gpu.csv")]
    args["router"]["policy_options"] = {**args["router"].get("policy_options", {}), "headroom_quantile": 0.0}
    args["workers"] = {**args["workers"], "num_workers": 1,
                       "autoscaling": {"min_workers": 1, "max_workers": 2, "target_requests": 1,
                                       "scale_down_delay_s": 15.0}}
    videos = {}
    sizes = []
    app = serving(config)
    url, _ = next(app)
    try:
        deadline = time.monotonic() + 400
        with httpx.Client(base_url=url, timeout=120) as client:
            def create(name):
                body = dict(VIDEO, num_inference_steps=STEPS[name], seed=SEEDS[name])
                videos[name] = client.post("/v1/videos", json=body).json()["id"]

            def finish(name):
                wait_until(client, url, videos[name], lambda v: v["status"] == "completed", deadline)

            assert pool_state()["workers"] == 1
            create("a")
            create("b")  # demand 2: a second worker starts (it may load after both are done)
            finish("a")
            finish("b")
            while pool_state()["live_workers"] < 2:  # within the lull's 15 s, or it is stopped
                assert time.monotonic() < deadline, pool_state()
                time.sleep(0.2)
            sizes.append(pool_state())
            create("c")  # both workers idle and in one world: SP 2
            finish("c")
            while pool_state()["workers"] > 1:  # the lull after it: back to one worker
                assert time.monotonic() < deadline, pool_state()
                time.sleep(0.5)
            create("d")
            finish("d")
            sizes.append(pool_state())
            frames = {name: client.get(f"/v1/videos/{vid}/content", params={"variant": "frames"}).content
                      for name, vid in videos.items()}
            records = {name: job_record(vid) for name, vid in videos.items()}
            polled = {name: poll(client, url, vid) for name, vid in videos.items()}
    finally:
        app.close()
    assert sizes[0]["workers"] == 2 and sizes[0]["live_workers"] == 2
    assert sizes[1]["workers"] == 1
    assert set(records["c"].sp_degrees) == {2}, records["c"].sp_degrees
    assert set(records["d"].sp_degrees) == {1}, records["d"].sp_degrees
    for name, seed in SEEDS.items():
        assert polled[name]["status"] == "completed"
        expected = reference_frames(steps=STEPS[name], seed=seed, frames=VIDEO["num_frames"])
        assert np.abs(unzip_frames(frames[name]).astype(int) - expected.astype(int)).max() <= 1, name
