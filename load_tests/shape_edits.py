"""Masked edits of the shapes models' pictures, for the benchmarks that judge edits: each held-out
scene's render is a template, and an edit of it recolours its shape, asked by the caption of the
scene with the new colour, its mask the square around the shape (its jitter and anti-aliased edge
included). At a strength below 1 the edit keeps the old shape's outline and paints it anew, as an
edit of a product's colour does; the judge then names the shape and the new colour.

Recolouring, not redrawing: at 64 px `shapes-sd3` draws a shape it is asked for from noise 42% of
the time (docs/results/shapes), while a recolour at strength 0.6 keeps most shapes (55% of edits
judged right)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import PIL.Image

from stepserve.engine.inpaint import edit_pixels, mask_ratio
from stepserve.engine.sampler import RequestInputs
from stepserve.engine.shapes import dataset
from stepserve.policies.types import RequestKind, RequestSpec

MARGIN_PX = 2  # beyond the shape's radius and jitter: its anti-aliased edge


def edit_box(scene: dataset.Scene, size: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) in pixels of the square that holds `scene`'s shape wherever
    its jitter put it."""
    fx, fy = dataset.POSITIONS[scene.position]
    reach = (dataset.SIZES[scene.size] + dataset.JITTER) * size + MARGIN_PX
    left, top = (max(0, int(np.floor(f * size - reach))) for f in (fx, fy))
    right, bottom = (min(size, int(np.ceil(f * size + reach))) for f in (fx, fy))
    return left, top, right, bottom


def recoloured(scene: dataset.Scene, turn: int) -> dataset.Scene:
    """`scene` with its shape in the `turn`-th other colour (turn >= 1; never the old colour or
    the background), every part named in its caption."""
    colours = [c for c in dataset.COLOURS if c not in (scene.colour, scene.background)]
    return replace(scene, colour=colours[(turn - 1) % len(colours)], say_size=True, say_position=True)


def edit_requests(specs: Sequence[RequestSpec], scenes: Sequence[dataset.Scene], templates: np.ndarray,
                  strength: float, skipped_steps: int, template_ids: bool) -> list[tuple[RequestSpec, RequestInputs]]:
    """Each spec (its prompt: the new scene's caption) as an edit of its template picture (uint8
    [n, h, w, 3]) whose mask is the square of the old scene's shape, as the ingress makes it
    (`deployments.edit_validation`); naming the template (`template_id`: the spec's index) when
    `template_ids`."""
    edits = []
    for i, (spec, scene, picture) in enumerate(zip(specs, scenes, templates)):
        left, top, right, bottom = edit_box(scene, spec.width)
        area = np.zeros((spec.height, spec.width), np.uint8)
        area[top:bottom, left:right] = 255
        pixels, mask = edit_pixels(PIL.Image.fromarray(picture), PIL.Image.fromarray(area, mode="L"),
                                   spec.height, spec.width)
        edit = replace(spec, kind=RequestKind.EDIT, strength=strength, skip_steps=skipped_steps,
                       mask_ratio=mask_ratio(mask, 8), template_id=f"template-{i}" if template_ids else None)
        edits.append((edit, RequestInputs(image=pixels, mask=mask)))
    return edits
