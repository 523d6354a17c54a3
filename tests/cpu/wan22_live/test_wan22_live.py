"""Wan 2.2 served for real (configs/local-wan22.yaml) through the official openai client: videos of
both variants, created side by side with others of different lengths (so A14B forwards straddle
its high/low-noise boundary), equal plain WanPipeline 2.2 runs with the same seed, frame by frame."""

import io
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
from PIL import Image

from stepserve.engine.families import ALL_PARTS, load_family

from tests.tiny_video import TINY_WAN_A14B, TINY_WAN_TI2V, make_video_spec, solo_pipeline_video

SOURCES = {"tiny-wan-a14b": TINY_WAN_A14B, "tiny-wan-ti2v": TINY_WAN_TI2V}
PROMPT = "a red fox runs through snow"


def unzip_frames(data: bytes) -> np.ndarray:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = sorted(archive.namelist())
        return np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n))).convert("RGB")) for n in names])


def reference_frames(model: str, steps: int, seed: int, size: int, frames: int) -> np.ndarray:
    family = load_family(SOURCES[model], ALL_PARTS, "cpu")
    spec = make_video_spec(rid="ref", steps=steps, seed=seed, guidance=4.0, height=size, width=size, frames=frames,
                           prompt=PROMPT, model=model)
    video = solo_pipeline_video(family, spec)[0]
    return (video * 255).round().astype(np.uint8)  # as diffusers' numpy_to_pil


def test_both_wan22_variants_are_served_exactly(wan22_app):
    url, _ = wan22_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-wan-a14b", "tiny-wan-ti2v"]
    # (model, steps, seed): the checked videos first; shorter and longer ones join them.
    jobs = [("tiny-wan-a14b", 8, 11), ("tiny-wan-ti2v", 7, 12), ("tiny-wan-a14b", 3, 13), ("tiny-wan-ti2v", 12, 14),
            ("tiny-wan-a14b", 14, 15)]

    def create(job):
        model, steps, seed = job
        return client.videos.create(model=model, prompt=PROMPT, size="64x64",
                                    extra_body={"num_frames": 5, "num_inference_steps": steps, "seed": seed,
                                                "guidance_scale": 4.0})

    with ThreadPoolExecutor(len(jobs)) as pool:
        videos = list(pool.map(create, jobs))
    for video in videos:
        done = client.videos.retrieve(video.id, extra_headers={"Prefer": "wait=120"})
        assert done.status == "completed", done
    for (model, steps, seed), video in list(zip(jobs, videos))[:2]:
        frames = httpx.get(f"{url}/v1/videos/{video.id}/content", params={"variant": "frames"}, timeout=30)
        assert frames.status_code == 200, frames.text
        served = unzip_frames(frames.content)
        expected = reference_frames(model, steps, seed, 64, 5)
        assert served.shape == expected.shape == (5, 64, 64, 3)
        # 8-bit frames: float noise at 1e-5 can flip a rounding, nothing more.
        assert np.abs(served.astype(int) - expected.astype(int)).max() <= 1, model
