"""The edits the fidelity benchmark judges: a mask that holds the whole old shape, a new colour
that is neither the old one nor the background, requests as the ingress makes them."""

import numpy as np

from stepserve.engine.shapes import dataset
from stepserve.load_tests.shape_edits import edit_box, edit_requests, recoloured
from stepserve.policies.types import RequestKind, RequestSpec


def test_the_edit_box_holds_every_pixel_of_the_shape():
    renders = dataset.Renders(seed=3, count=60)
    for i, scene in enumerate(renders.scenes):
        picture = renders.pictures([i])[0].astype(int)
        drawn = np.abs(picture - np.array(dataset.COLOURS[scene.background])).max(-1) > 8
        left, top, right, bottom = edit_box(scene, dataset.SIZE)
        inside = np.zeros_like(drawn)
        inside[top:bottom, left:right] = True
        assert drawn.any() and not (drawn & ~inside).any(), (i, scene)
        assert (right - left) * (bottom - top) < 0.6 * dataset.SIZE ** 2  # an edit of part of the picture


def test_a_recoloured_scene_keeps_its_shape_and_place_and_names_them():
    for scene in dataset.Renders(seed=4, count=40).scenes:
        first, second = recoloured(scene, 1), recoloured(scene, 2)
        assert len({scene.colour, first.colour, second.colour, scene.background}) == 4
        assert (first.shape, first.position, first.size) == (scene.shape, scene.position, scene.size)
        assert first.caption.startswith(f"a {scene.size} {first.colour} {scene.shape} on ")
        assert first.caption.endswith(f" {scene.background} background, {scene.position}")


def test_edit_requests_are_masked_edits_of_their_templates():
    renders = dataset.Renders(seed=5, count=2)
    specs = [RequestSpec(request_id=f"e{i}", model="shapes-sd3", prompt=recoloured(s, 1).caption, width=64, height=64,
                         num_inference_steps=10, guidance_scale=3.0, seed=i) for i, s in enumerate(renders.scenes)]
    edits = edit_requests(specs, renders.scenes, renders.pictures([0, 1]), 0.6, 4, template_ids=True)
    for i, (spec, inputs) in enumerate(edits):
        assert spec.kind is RequestKind.EDIT and spec.strength == 0.6 and spec.skip_steps == 4
        assert spec.template_id == f"template-{i}" and 0 < spec.mask_ratio < 0.6
        np.testing.assert_array_equal(inputs.image, renders.pictures([i])[0])
        assert inputs.mask.shape == (64, 64) and set(np.unique(inputs.mask)) == {0, 255}
    plain = edit_requests(specs, renders.scenes, renders.pictures([0, 1]), 0.6, 4, template_ids=False)
    assert plain[0][0].template_id is None
