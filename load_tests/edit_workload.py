"""Edit requests for a workload: which requests are masked edits, their mask ratios and their
templates (InstGenIE §2.2, Fig. 3). Deterministic by seed, like `addon_mix.with_addons`.

Mask ratios follow a Beta distribution with the mean of one of the paper's traces and a wide
spread: the paper gives the traces' means and histograms, not the data. Fig. 3's histograms are
J-shaped (most masks small, a long tail to whole-image masks), which a Beta with concentration
alpha + beta = 4 reproduces: at mean 0.19, standard deviation 0.18, median 0.14, a quarter of
the masks over 0.28 and one in eighty over 0.7. Individual ratios vary widely, which is what makes balancing by request
count fail (§2.2, §4.4).

    their trace (face swap, 14 days, 34M images)    mean 0.11
    public trace (image restoration and others)     mean 0.19
    virtual try-on benchmark (VITON-HD)              mean 0.35

An edit whose template's activations are cached (`template_id` set) computes only its masked
tokens; one without (an image never seen before) computes every token. In the paper's trace 970
templates served 34M images, so nearly every edit finds its template: `cached` = 1 by default.
"""

from __future__ import annotations

import io
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import PIL.Image

from stepserve.load_tests.workload import ScheduledRequest


@dataclass(frozen=True)
class ScheduledEdit(ScheduledRequest):
    """A masked edit (`RequestKind.EDIT`) of an image: live, `POST /v1/images/edits` (multipart)
    of its template's picture (`template_png`) under a centred mask of about `mask_ratio`."""

    mask_ratio: float = 1.0  # the fraction of the latent grid the mask covers
    template_id: str | None = None  # the template whose activations are cached; None: none are

    def body(self) -> dict[str, Any]:
        body = super().body()
        body.pop("size")  # an edit has its image's size
        if self.template_id is not None:
            body["template_id"] = self.template_id
        return body

    def files(self) -> dict[str, tuple[str, bytes, str]]:
        picture = template_png(self.width, self.height, self.template_id or f"image-{self.index}")
        return {"image": ("image.png", picture, "image/png"),
                "mask": ("mask.png", mask_png(self.width, self.height, self.mask_ratio), "image/png")}


def template_png(width: int, height: int, name: str) -> bytes:
    """A smooth random picture, the same for one name (a template is a real image, not noise)."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    small = PIL.Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((width, height),
                                                                                        PIL.Image.BICUBIC)
    out = io.BytesIO()
    small.save(out, format="PNG")
    return out.getvalue()


def mask_png(width: int, height: int, ratio: float, grid: int = 16) -> bytes:
    """OpenAI's mask: opaque, a centred rectangle of about `ratio` of the image fully transparent,
    its sides on a `grid` of pixels (16: SD3's 2x2 latent patches), at least one cell."""
    def side(length: int) -> int:
        return min(length, max(grid, int(round(length * ratio ** 0.5 / grid)) * grid))
    w, h = side(width), side(height)
    left, top = (width - w) // 2 // grid * grid, (height - h) // 2 // grid * grid
    alpha = np.full((height, width), 255, dtype=np.uint8)
    alpha[top:top + h, left:left + w] = 0
    out = io.BytesIO()
    PIL.Image.fromarray(np.dstack([np.zeros((height, width, 3), np.uint8), alpha]), mode="RGBA").save(out, format="PNG")
    return out.getvalue()


@dataclass(frozen=True)
class MaskRatios:
    """Beta-distributed mask ratios with this `mean`, alpha + beta = `concentration` (smaller
    spreads wider), never below `floor` (an empty mask edits nothing)."""

    mean: float
    concentration: float = 4.0
    floor: float = 0.01

    def __post_init__(self) -> None:
        if not (0.0 < self.mean < 1.0 and self.concentration > 0 and 0.0 <= self.floor < 1.0):
            raise ValueError(f"need 0 < mean < 1, concentration > 0 and 0 <= floor < 1, got {self}")

    def draw(self, rng: random.Random) -> float:
        alpha = self.mean * self.concentration
        return max(self.floor, rng.betavariate(alpha, self.concentration - alpha))


TRACES = {
    "instgenie": MaskRatios(0.11),
    "public": MaskRatios(0.19),
    "viton": MaskRatios(0.35),
}


@dataclass(frozen=True)
class EditMix:
    """Which requests are edits (`share`), their ratios, and their templates: one of `templates`
    (uniform), cached with probability `cached`."""

    ratios: MaskRatios
    share: float = 1.0
    templates: int = 970
    cached: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.share <= 1.0 and 0.0 <= self.cached <= 1.0 and self.templates >= 1):
            raise ValueError(f"need share and cached in [0, 1] and templates >= 1, got {self}")

    @classmethod
    def trace(cls, name: str, **changes) -> "EditMix":
        """The mix of one of the paper's traces (`TRACES`)."""
        try:
            return cls(TRACES[name], **changes)
        except KeyError:
            raise ValueError(f"unknown trace {name!r}; known: {sorted(TRACES)}") from None


def with_edits(requests: Sequence[ScheduledRequest], mix: EditMix, seed: int) -> list[ScheduledRequest]:
    """The workload's requests, a `mix.share` of them turned into edits (video requests stay).

    Every request makes the same draws, edit or not, so two mixes with one seed differ only
    where they must.
    """
    rng = random.Random(f"{seed}:edits")
    out: list[ScheduledRequest] = []
    for request in requests:
        is_edit = rng.random() < mix.share and not request.is_video
        ratio = mix.ratios.draw(rng)
        template = rng.randrange(mix.templates)
        cached = rng.random() < mix.cached
        if not is_edit:
            out.append(request)
            continue
        values = {f.name: getattr(request, f.name) for f in fields(request)}
        out.append(ScheduledEdit(**values, mask_ratio=ratio, template_id=f"template-{template}" if cached else None))
    return out
