"""Pictures of one simple shape each, with their captions, rendered on the fly from a seed.

Caption grammar (every caption the models were trained on is one of these):

    a|an [small |large ]<colour> <shape> on a|an <background> background[, <position>]

- shape: circle, square, triangle, star
- colour, background: red, green, blue, yellow, purple, orange, white, black (never equal)
- position: top left, top right, bottom left, bottom right, center
- the size word and the position are each left out of some captions (then they are drawn at
  random), so prompts without them are in the language too.

Sample `i` of seed `s` is always the same picture and caption: each is drawn from its own
generator seeded by (s, i), so a subset, a shuffle or another process gets the same data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "purple": (140, 50, 170), "orange": (245, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}
POSITIONS = {  # the shape's centre, as a fraction of the side
    "top left": (0.3, 0.3), "top right": (0.7, 0.3), "bottom left": (0.3, 0.7), "bottom right": (0.7, 0.7),
    "center": (0.5, 0.5),
}
SIZES = {"small": 0.2, "large": 0.3}  # the shape's radius, as a fraction of the side
SIZE = 64  # training resolution (8x8 latents)
SUPERSAMPLE = 4  # drawn larger and downsampled: anti-aliased edges
# How often a caption leaves a part out (its value is then still drawn, at random).
OMIT_SIZE = 0.5
OMIT_POSITION = 0.3
JITTER = 0.03  # the centre moves by up to this fraction of the side


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    background: str
    position: str
    size: str
    say_size: bool = True
    say_position: bool = True

    @property
    def caption(self) -> str:
        size = f"{self.size} " if self.say_size else ""
        where = f", {self.position}" if self.say_position else ""
        return f"{_article(size or self.colour)} {size}{self.colour} {self.shape} on " \
               f"{_article(self.background)} {self.background} background{where}"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def scene(rng: np.random.Generator) -> Scene:
    colours = list(COLOURS)
    colour = colours[rng.integers(len(colours))]
    background = [c for c in colours if c != colour][rng.integers(len(colours) - 1)]
    return Scene(
        shape=SHAPES[rng.integers(len(SHAPES))], colour=colour, background=background,
        position=list(POSITIONS)[rng.integers(len(POSITIONS))], size=list(SIZES)[rng.integers(len(SIZES))],
        say_size=bool(rng.random() >= OMIT_SIZE), say_position=bool(rng.random() >= OMIT_POSITION),
    )


def _outline(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """The polygon of `shape` (None for the circle), pointing up."""
    if shape == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * 0.15 - r * math.sin(a))
                for a in (math.pi / 2, math.pi / 2 + 2 * math.pi / 3, math.pi / 2 + 4 * math.pi / 3)]
    if shape == "star":
        return [(cx + rr * math.cos(a), cy - rr * math.sin(a))
                for k in range(10) for a, rr in [(math.pi / 2 + k * math.pi / 5, r if k % 2 == 0 else r * 0.45)]]
    return None


def render(s: Scene, rng: np.random.Generator, size: int = SIZE, style: str = "filled") -> np.ndarray:
    """The scene as uint8 RGB [size, size, 3]. `style` "outlined" draws only the shape's edge (the
    style the shipped LoRA teaches)."""
    big = size * SUPERSAMPLE
    fx, fy = POSITIONS[s.position]
    cx = (fx + rng.uniform(-JITTER, JITTER)) * big
    cy = (fy + rng.uniform(-JITTER, JITTER)) * big
    r = SIZES[s.size] * big
    image = Image.new("RGB", (big, big), COLOURS[s.background])
    draw = ImageDraw.Draw(image)
    fill, outline = (COLOURS[s.colour], None) if style == "filled" else (None, COLOURS[s.colour])
    width = max(1, round(0.05 * big)) if style == "outlined" else 0
    polygon = _outline(s.shape, cx, cy, r)
    if polygon is None:
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill, outline=outline, width=width)
    else:
        draw.polygon(polygon, fill=fill, outline=outline, width=width)
    return np.asarray(image.resize((size, size), Image.Resampling.LANCZOS))


def silhouette(s: Scene, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """The scene's shape in white on black, uint8 RGB: the ControlNet's control image."""
    mask_scene = Scene(s.shape, "white", "black", s.position, s.size)
    return render(mask_scene, rng, size)


def sample(seed: int, index: int, size: int = SIZE, style: str = "filled") -> tuple[Scene, np.ndarray, np.ndarray]:
    """Sample `index` of `seed`: its scene, picture and silhouette (the same jitter in both)."""
    rng = np.random.default_rng((seed, index))
    s = scene(rng)
    state = rng.bit_generator.state
    picture = render(s, rng, size, style)
    rng.bit_generator.state = state
    return s, picture, silhouette(s, rng, size)


def batch(seed: int, start: int, count: int, size: int = SIZE, style: str = "filled"
          ) -> tuple[list[Scene], np.ndarray, np.ndarray]:
    """Samples start..start+count-1: scenes, pictures [n, size, size, 3] and silhouettes, uint8."""
    out = [sample(seed, i, size, style) for i in range(start, start + count)]
    return [o[0] for o in out], np.stack([o[1] for o in out]), np.stack([o[2] for o in out])


class Renders:
    """Samples 0..count-1 of `seed` in one style, each rendered the first time it is asked for
    (a short run, such as the reproducibility test's, renders only what it draws)."""

    def __init__(self, seed: int, count: int, style: str = "filled", size: int = SIZE):
        self.seed, self.style, self.size = seed, style, size
        self.scenes = [scene(np.random.default_rng((seed, i))) for i in range(count)]
        self._pictures = np.zeros((count, size, size, 3), np.uint8)
        self._silhouettes = np.zeros((count, size, size, 3), np.uint8)
        self._done = np.zeros(count, bool)

    def __len__(self) -> int:
        return len(self.scenes)

    def _render(self, indices: np.ndarray) -> None:
        for i in indices[~self._done[indices]]:
            _, self._pictures[i], self._silhouettes[i] = sample(self.seed, int(i), self.size, self.style)
            self._done[i] = True

    def pictures(self, indices) -> np.ndarray:
        indices = np.asarray(indices)
        self._render(indices)
        return self._pictures[indices]

    def silhouettes(self, indices) -> np.ndarray:
        indices = np.asarray(indices)
        self._render(indices)
        return self._silhouettes[indices]
