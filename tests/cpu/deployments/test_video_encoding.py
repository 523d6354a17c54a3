"""Frames → MP4 that decodes back (PyAV) to the same frames; ZIP of PNGs when PyAV is missing."""

import io
import zipfile

import av
import numpy as np
import pytest
from PIL import Image

from stepserve.deployments import video_encoding
from stepserve.deployments.video_encoding import ENCODERS, encode_video, mp4, mp4_encoder


def smooth_frames(frames: int, height: int, width: int) -> np.ndarray:
    """A moving colour gradient: content a lossy codec keeps close, unlike noise."""
    t, y, x = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
    rgb = np.stack([(x * 4 + t * 8) % 256, (y * 4) % 256, np.full_like(x, 128)], axis=-1)
    return rgb.astype(np.uint8)


def decode(data: bytes):
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return frames, stream


def available_encoders() -> list[str]:
    out = []
    for name in ENCODERS:
        try:
            av.Codec(name, "w")
            out.append(name)
        except Exception:
            pass
    return out


def test_an_encoder_is_found_h264_first():
    chosen = mp4_encoder()
    assert chosen is not None and chosen == available_encoders()[0]


def test_mp4_decodes_to_the_same_frames():
    frames = smooth_frames(9, 64, 64)  # Wan's smallest useful shape: 4k+1 frames, 64x64
    video = encode_video(frames, fps=16)
    assert (video.media_type, video.format, video.codec) == ("video/mp4", "mp4", mp4_encoder())
    assert video.data[4:8] == b"ftyp"
    decoded, stream = decode(video.data)
    assert len(decoded) == 9 and all(f.shape == (64, 64, 3) for f in decoded)
    assert stream.codec_context.pix_fmt == "yuv420p"
    assert stream.average_rate == 16
    error = np.abs(np.stack(decoded).astype(int) - frames.astype(int)).mean()
    assert error < 4, error


@pytest.mark.parametrize("codec", available_encoders())
def test_every_available_encoder_writes_a_playable_file(codec):
    frames = smooth_frames(5, 48, 80)
    data = mp4(frames, 8, codec)
    decoded, stream = decode(data)
    assert len(decoded) == 5 and decoded[0].shape == (48, 80, 3)
    assert stream.codec_context.pix_fmt == "yuv420p"
    assert data.find(b"moov") < data.find(b"mdat")  # faststart: playable while downloading


def test_odd_sides_are_padded_to_even():
    frames = smooth_frames(3, 33, 31)
    decoded, _ = decode(encode_video(frames, fps=8).data)
    assert len(decoded) == 3 and decoded[0].shape == (34, 32, 3)


def test_single_frame_and_random_content():
    frames = np.random.default_rng(0).integers(0, 256, (1, 16, 16, 3), dtype=np.uint8)
    decoded, _ = decode(encode_video(frames, fps=1).data)
    assert len(decoded) == 1 and decoded[0].shape == (16, 16, 3)


def test_without_pyav_frames_come_back_as_a_zip_of_pngs(monkeypatch):
    monkeypatch.setattr(video_encoding, "av", None)
    frames = np.random.default_rng(1).integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    video = encode_video(frames, fps=16)
    assert (video.media_type, video.format, video.codec) == ("application/zip", "png-zip", None)
    with zipfile.ZipFile(io.BytesIO(video.data)) as archive:
        names = archive.namelist()
        assert names == [f"frame_{i:05d}.png" for i in range(5)]
        back = np.stack([np.asarray(Image.open(io.BytesIO(archive.read(n)))) for n in names])
    np.testing.assert_array_equal(back, frames)  # PNG is lossless


@pytest.mark.parametrize("frames,fps", [
    (np.zeros((2, 16, 16, 3), np.float32), 8),   # not uint8
    (np.zeros((16, 16, 3), np.uint8), 8),        # no frame axis
    (np.zeros((2, 16, 16, 4), np.uint8), 8),     # RGBA
    (np.zeros((0, 16, 16, 3), np.uint8), 8),     # no frames
    (np.zeros((2, 16, 16, 3), np.uint8), 0),     # no frame rate
])
def test_bad_frames_are_refused(frames, fps):
    with pytest.raises(ValueError):
        encode_video(frames, fps)
