"""Frames → a video file: MP4 (H.264, or MPEG-4 Part 2) with PyAV, else a ZIP of PNG frames.

MP4 needs the `av` package (a stepserve dependency; its wheels bundle FFmpeg). Its FFmpeg build
decides which encoder exists, so the first of ENCODERS it has is used. Without `av` at all (a
trimmed install), the frames still reach the caller, as numbered PNGs in a ZIP; the response says
which with its content type and the `X-Stepserve-Video-Format` header (`mp4` or `png-zip`; the
preview images of `video_previews` say `webp` or `jpeg`).

Runs in the ingress, off the step loop, in a worker thread (callers use `asyncio.to_thread`).
"""

from __future__ import annotations

import io
import os
import tempfile
import zipfile
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from PIL import Image

try:
    import av
except ImportError:  # only trimmed installs: `av` is a declared dependency
    av = None

# H.264 plays everywhere (browsers, ffprobe); FFmpeg's own "h264" name resolves to whichever
# H.264 encoder the build has. MPEG-4 Part 2 is FFmpeg's native encoder, always built in, and
# still plays in ffprobe/VLC (not in every browser).
ENCODERS = ("libx264", "h264", "mpeg4")
FORMAT_HEADER = "X-Stepserve-Video-Format"


@dataclass(frozen=True)
class EncodedVideo:
    """One downloadable form of a finished video: the clip, its frames, or a preview image."""

    data: bytes
    media_type: str  # "video/mp4", "application/zip", "image/webp" or "image/jpeg"
    format: str  # "mp4", "png-zip", "webp" or "jpeg": the X-Stepserve-Video-Format header
    codec: str | None  # the encoder used for mp4; None otherwise


def mp4_encoder() -> str | None:
    """The first encoder of ENCODERS that this PyAV's FFmpeg can encode with, or None."""
    if av is None:
        return None
    for name in ENCODERS:
        if name not in av.codecs_available:
            continue
        try:
            av.Codec(name, "w")  # present as a decoder only is not enough
        except Exception:
            continue
        return name
    return None


def encode_video(frames: np.ndarray, fps: int) -> EncodedVideo:
    """`frames` uint8 [F, H, W, 3] (RGB) → an MP4, or a ZIP of PNGs when PyAV has no encoder."""
    check_frames(frames)
    if fps < 1:
        raise ValueError(f"fps must be >= 1, got {fps}")
    codec = mp4_encoder()
    if codec is None:
        return frames_zip(frames)
    return EncodedVideo(mp4(frames, fps, codec), "video/mp4", "mp4", codec)


def frames_zip(frames: np.ndarray) -> EncodedVideo:
    """Every frame as a lossless PNG, numbered in order, in one ZIP."""
    check_frames(frames)
    return EncodedVideo(png_zip(frames), "application/zip", "png-zip", None)


def check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got {frames.dtype} {frames.shape}")


def mp4(frames: np.ndarray, fps: int, codec: str) -> bytes:
    # 4:2:0 chroma halves both sides, and players only take yuv420p from H.264 reliably: odd
    # sides are padded by repeating the last row/column rather than cropping content away.
    frames = np.pad(frames, ((0, 0), (0, frames.shape[1] % 2), (0, frames.shape[2] % 2), (0, 0)), mode="edge")
    _, height, width, _ = frames.shape
    # faststart moves the index to the front so a browser can play while downloading; the muxer
    # does that by reopening its output by name, so it writes a temporary file, not a BytesIO.
    with tempfile.TemporaryDirectory(prefix="stepserve-mp4-") as tmp:
        path = os.path.join(tmp, "video.mp4")
        _mux(frames, fps, codec, path)
        with open(path, "rb") as f:
            return f.read()


def _mux(frames: np.ndarray, fps: int, codec: str, path: str) -> None:
    _, height, width, _ = frames.shape
    with av.open(path, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.time_base = Fraction(1, fps)
        if stream.codec_context.name == "libx264":
            # Near-lossless and quick: ingress CPU time matters more than a few kilobytes.
            stream.options = {"crf": "18", "preset": "veryfast"}
        else:
            stream.bit_rate = max(1_000_000, width * height * fps * 2)  # mpeg4's default (200 kb/s) is a smear
        for index, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))  # flush the encoder's delayed frames


def png_zip(frames: np.ndarray) -> bytes:
    out = io.BytesIO()
    # PNGs are already compressed; storing them avoids deflating twice.
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as archive:
        for index, rgb in enumerate(frames):
            png = io.BytesIO()
            Image.fromarray(rgb, mode="RGB").save(png, format="PNG")
            archive.writestr(f"frame_{index:05d}.png", png.getvalue())
    return out.getvalue()
