"""A finished video's preview images, OpenAI's `thumbnail` and `spritesheet` content variants.

- thumbnail: the first frame at the video's own size, as WebP (quality THUMBNAIL_QUALITY). The
  first frame is what a player shows before play starts, so a listing's thumbnail and the
  player's poster agree, and it exists for every frame count.
- spritesheet: up to MAX_SPRITES evenly spaced frames (the first and the last among them), in
  time order left to right, top to bottom, on a near-square grid (`sprite_grid`), as JPEG
  (quality SPRITESHEET_QUALITY). Tiles keep the video's aspect ratio and its size unless the
  sheet would exceed MAX_SHEET_SIDE on a side; then every tile shrinks by one factor. Cells past
  the last sprite stay black. A client can slice the sheet knowing only the video's
  `num_frames`: the grid follows from it, and a tile is the sheet's width / columns wide.

Lossy formats on purpose: these are light previews for listings and scrubbers (OpenAI serves
WebP and JPEG too); the exact frames are the `frames` variant. Runs in the ingress, off the
event loop, in a worker thread (callers use `asyncio.to_thread`).
"""

from __future__ import annotations

import io
import math

import numpy as np
from PIL import Image

from stepserve.deployments.video_encoding import EncodedVideo, check_frames

THUMBNAIL_QUALITY = 90
SPRITESHEET_QUALITY = 85
MAX_SPRITES = 16  # a 4x4 sheet: enough to scrub a clip, small enough to fetch with a listing
MAX_SHEET_SIDE = 2048  # pixels; 16 tiles of 1280x720 would otherwise make a 5120x2880 sheet


def thumbnail(frames: np.ndarray) -> EncodedVideo:
    """`frames` uint8 [F, H, W, 3] (RGB) → the first frame as a WebP image."""
    check_frames(frames)
    out = io.BytesIO()
    Image.fromarray(frames[0], mode="RGB").save(out, format="WEBP", quality=THUMBNAIL_QUALITY)
    return EncodedVideo(out.getvalue(), "image/webp", "webp", None)


def spritesheet(frames: np.ndarray) -> EncodedVideo:
    """`frames` uint8 [F, H, W, 3] (RGB) → evenly spaced frames tiled in one JPEG image."""
    check_frames(frames)
    count, height, width, _ = frames.shape
    indices = sprite_indices(count)
    columns, rows = sprite_grid(len(indices))
    tile_w, tile_h = tile_size(width, height, columns, rows)
    sheet = Image.new("RGB", (columns * tile_w, rows * tile_h))
    for cell, index in enumerate(indices):
        tile = Image.fromarray(frames[index], mode="RGB")
        if tile.size != (tile_w, tile_h):
            tile = tile.resize((tile_w, tile_h), Image.Resampling.LANCZOS, reducing_gap=3.0)
        row, column = divmod(cell, columns)
        sheet.paste(tile, (column * tile_w, row * tile_h))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=SPRITESHEET_QUALITY)
    return EncodedVideo(out.getvalue(), "image/jpeg", "jpeg", None)


def sprite_indices(count: int) -> list[int]:
    """min(count, MAX_SPRITES) frame indices, evenly spaced from the first frame to the last."""
    sprites = min(count, MAX_SPRITES)
    if sprites == 1:
        return [0]
    # Integer steps, so the same clip always gives the same sheet; distinct as count >= sprites.
    return [i * (count - 1) // (sprites - 1) for i in range(sprites)]


def sprite_grid(sprites: int) -> tuple[int, int]:
    """(columns, rows) of the most nearly square grid, wider than tall, that holds `sprites`:
    16 → 4x4, 9 → 3x3, 5 → 3x2."""
    columns = math.isqrt(sprites - 1) + 1  # ceil(sqrt(sprites))
    return columns, -(-sprites // columns)


def tile_size(width: int, height: int, columns: int, rows: int) -> tuple[int, int]:
    """The video's frame size, scaled down (never up) so the sheet fits MAX_SHEET_SIDE."""
    scale = min(1.0, MAX_SHEET_SIDE / max(columns * width, rows * height))
    return max(1, int(width * scale)), max(1, int(height * scale))
