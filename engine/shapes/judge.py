"""The judge: a small CNN that names the shape and the colour in a picture, trained on the
dataset's own renders. `prompt_accuracy` is the share of generated pictures whose shape and
colour both match what their prompts asked for."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

from stepserve.engine.shapes import dataset

SIDE = 64  # the judge looks at every picture at this size


def pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 [n, h, w, 3] as the models' input: float [n, 3, h, w] in [-1, 1]."""
    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 127.5 - 1


class Judge(ModelMixin, ConfigMixin):
    """Four strided convolutions, then one linear head per question (shape, colour)."""

    @register_to_config
    def __init__(self, width: int = 32, shapes: int = len(dataset.SHAPES), colours: int = len(dataset.COLOURS)):
        super().__init__()
        layers, channels = [], 3
        for out in (width, width * 2, width * 2, width * 4):
            layers += [nn.Conv2d(channels, out, 3, stride=2, padding=1), nn.GroupNorm(8, out), nn.SiLU()]
            channels = out
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.shape_head = nn.Linear(channels, shapes)
        self.colour_head = nn.Linear(channels, colours)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images: float [n, 3, h, w] in [-1, 1]; returns (shape logits, colour logits)."""
        if images.shape[-2:] != (SIDE, SIDE):
            images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", antialias=True, align_corners=False)
        features = self.features(images)
        return self.shape_head(features), self.colour_head(features)

    @torch.no_grad()
    def name(self, images: np.ndarray) -> list[tuple[str, str]]:
        """(shape, colour) of each uint8 RGB picture [n, h, w, 3]."""
        shape_logits, colour_logits = self(pixels(images).to(self.device, self.dtype))
        colours = list(dataset.COLOURS)
        return [(dataset.SHAPES[s], colours[c])
                for s, c in zip(shape_logits.argmax(1).tolist(), colour_logits.argmax(1).tolist())]


def judge_targets(scenes: Sequence[dataset.Scene]) -> tuple[torch.Tensor, torch.Tensor]:
    colours = list(dataset.COLOURS)
    return (torch.tensor([dataset.SHAPES.index(s.shape) for s in scenes]),
            torch.tensor([colours.index(s.colour) for s in scenes]))


def prompt_accuracy(judge: Judge, images: np.ndarray, scenes: Sequence[dataset.Scene]) -> float:
    """The share of `images` whose shape and colour are those `scenes` (their prompts) asked for."""
    named = judge.name(images)
    return float(np.mean([(shape, colour) == (s.shape, s.colour) for (shape, colour), s in zip(named, scenes)]))
