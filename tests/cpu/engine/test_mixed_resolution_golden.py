"""Golden: SD3 requests of different resolutions stepped in one group (one packed forward a
step, `SD3Family.denoise_mixed`) through the step runner, joining at different steps, each equal
the plain `StableDiffusion3Pipeline` run alone with the same seed. (A family without the packed
forward mode, `ModeName.PACKED`, refuses such a group: test_pack_resolutions.py.)"""

from dataclasses import replace

import numpy as np
import torch

from tests.tiny import make_spec, run_continuous_batch, solo_pipeline_image


def test_mixed_resolutions_in_one_group_equal_each_pipeline_alone(tiny_sd3):
    small = make_spec("small", steps=4, seed=1, size=64, model="tiny-sd3")
    large = make_spec("large", steps=3, seed=2, size=128, model="tiny-sd3", prompt="a lighthouse at dusk")
    wide = replace(make_spec("wide", steps=3, seed=3, size=64, model="tiny-sd3", negative="blurry"), width=128)
    unguided = make_spec("unguided", steps=3, seed=4, size=96, model="tiny-sd3", guidance=1.0)  # one row, no CFG
    finished = run_continuous_batch(tiny_sd3, {0: [small, large], 1: [wide, unguided]})
    assert set(finished) == {"small", "large", "wide", "unguided"}
    for spec in (small, large, wide, unguided):
        latents = finished[spec.request_id]
        assert latents.shape[2:] == (spec.height // 8, spec.width // 8)
        image = tiny_sd3.decode(torch.from_numpy(latents))[0]
        np.testing.assert_allclose(image, solo_pipeline_image(tiny_sd3, spec), atol=2e-5, err_msg=spec.request_id)
