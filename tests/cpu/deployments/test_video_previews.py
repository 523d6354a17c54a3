"""Frames → the thumbnail (first frame, WebP) and the spritesheet (evenly spaced frames on a grid, JPEG)."""

import io

import numpy as np
import pytest
from PIL import Image

from stepserve.deployments import video_previews
from stepserve.deployments.video_previews import sprite_grid, sprite_indices, spritesheet, thumbnail, tile_size


def smooth_frames(frames: int, height: int, width: int) -> np.ndarray:
    """A gradient whose colour moves with time: lossy codecs keep it close, and frames differ."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    rgb = np.stack([(x * 4 + t * 24) % 256, (y * 4) % 256, (t * 40) % 256], axis=-1)
    return rgb.astype(np.uint8)


def decode(data: bytes, image_format: str) -> np.ndarray:
    image = Image.open(io.BytesIO(data))
    assert image.format == image_format
    return np.asarray(image.convert("RGB")).astype(int)


def mean_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


def cells(sheet: np.ndarray, columns: int, rows: int) -> list[np.ndarray]:
    tile_h, tile_w = sheet.shape[0] // rows, sheet.shape[1] // columns
    return [sheet[r * tile_h:(r + 1) * tile_h, c * tile_w:(c + 1) * tile_w]
            for r in range(rows) for c in range(columns)]


def test_thumbnail_is_the_first_frame_as_webp():
    frames = smooth_frames(9, 48, 80)
    preview = thumbnail(frames)
    assert (preview.media_type, preview.format, preview.codec) == ("image/webp", "webp", None)
    image = decode(preview.data, "WEBP")
    assert image.shape == (48, 80, 3)  # the video's own size
    assert mean_error(image, frames[0]) < 3  # lossy, but close
    assert mean_error(image, frames[0]) < min(mean_error(image, f) for f in frames[1:])


@pytest.mark.parametrize("count,grid,chosen", [
    (1, (1, 1), [0]),
    (5, (3, 2), [0, 1, 2, 3, 4]),  # every frame when there are at most 16
    (9, (3, 3), list(range(9))),
    (17, (4, 4), [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16]),
    (81, (4, 4), [0, 5, 10, 16, 21, 26, 32, 37, 42, 48, 53, 58, 64, 69, 74, 80]),
])
def test_sprites_are_evenly_spaced_on_a_near_square_grid(count, grid, chosen):
    assert sprite_indices(count) == chosen
    assert sprite_grid(len(chosen)) == grid


@pytest.mark.parametrize("sprites,grid", [(2, (2, 1)), (3, (2, 2)), (4, (2, 2)), (10, (4, 3)), (13, (4, 4))])
def test_the_grid_is_wider_than_tall_and_holds_every_sprite(sprites, grid):
    columns, rows = sprite_grid(sprites)
    assert (columns, rows) == grid and columns * rows >= sprites > columns * (rows - 1)


def test_spritesheet_tiles_the_chosen_frames_in_time_order():
    frames = smooth_frames(5, 32, 48)
    sheet = spritesheet(frames)
    assert (sheet.media_type, sheet.format, sheet.codec) == ("image/jpeg", "jpeg", None)
    image = decode(sheet.data, "JPEG")
    assert image.shape == (2 * 32, 3 * 48, 3)  # 3x2 tiles at the video's own size
    tiles = cells(image, 3, 2)
    for index, tile in enumerate(tiles[:5]):
        errors = [mean_error(tile, frame) for frame in frames]
        assert int(np.argmin(errors)) == index and errors[index] < 6, errors
    assert tiles[5].mean() < 4  # the cell past the last sprite stays black (but for JPEG ringing at its edges)


def test_a_large_sheet_is_scaled_down_to_the_bound():
    assert tile_size(1280, 720, 4, 4) == (512, 288)  # a 5120x2880 sheet becomes 2048x1152
    assert tile_size(832, 480, 4, 4) == (512, 295)  # each side scaled by the same factor, floored
    assert tile_size(64, 64, 3, 3) == (64, 64)  # never scaled up
    assert tile_size(5000, 2, 1, 1) == (2048, 1)  # a side never reaches 0


def test_spritesheet_sides_stay_within_the_bound(monkeypatch):
    monkeypatch.setattr(video_previews, "MAX_SHEET_SIDE", 100)
    frames = smooth_frames(17, 48, 64)
    image = decode(spritesheet(frames).data, "JPEG")
    assert image.shape == (4 * 18, 4 * 25, 3)  # 4x4 tiles of 64x48 scaled by 100/256
    first = np.asarray(Image.fromarray(frames[0]).resize((25, 18), Image.Resampling.LANCZOS))
    assert mean_error(image[:18, :25], first) < 8


@pytest.mark.parametrize("frames", [
    np.zeros((2, 16, 16, 3), np.float32),  # not uint8
    np.zeros((16, 16, 3), np.uint8),  # no frame axis
    np.zeros((0, 16, 16, 3), np.uint8),  # no frames
])
def test_bad_frames_are_refused(frames):
    for preview in (thumbnail, spritesheet):
        with pytest.raises(ValueError):
            preview(frames)
