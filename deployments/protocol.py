"""Request and response bodies of the HTTP API (OpenAI Images API plus common extensions).

The same types serve DeploymentHandle callers: `ingress.generate.remote(ImageGenerationRequest(...))`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ImageGenerationRequest(BaseModel):
    # Unknown fields are an error, not silently ignored: a typo must not change the image.
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(description="What to draw.")
    model: str | None = Field(default=None, description="Served model id; defaults to the first configured.")
    n: int = Field(default=1, description="Images to generate; image i uses seed + i.")
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT' or 'auto' (the model's default).")
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json", description="Only b64_json is served; 'url' is rejected with 400."
    )
    negative_prompt: str | None = Field(default=None, description="What to steer away from (needs CFG).")
    num_inference_steps: int | None = Field(default=None, description="Denoising steps.")
    guidance_scale: float | None = Field(default=None, description="Classifier-free guidance; <= 1 turns CFG off.")
    seed: int | None = Field(default=None, description="Noise seed; random when omitted (returned per image).")
    user: str | None = Field(default=None, description="Accepted for OpenAI compatibility; unused.")


class ImageData(BaseModel):
    b64_json: str
    seed: int


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
