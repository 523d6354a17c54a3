"""Request and response bodies of the HTTP API (OpenAI Images API plus common extensions).

The same types serve DeploymentHandle callers: `ingress.generate.remote(ImageGenerationRequest(...))`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ImageOptions(BaseModel):
    """OpenAI's image parameters that generations and edits share: the step preset, the file the
    response carries, and the end-user ids (recorded, never changing an image)."""

    model_config = ConfigDict(extra="forbid")

    quality: str | None = Field(
        default=None, description="The step preset when num_inference_steps is omitted (explicit steps win): 'low', "
        "'medium' or 'high' are the model's low_quality_steps, default_steps and high_quality_steps; 'auto' (the "
        "default) and 'standard' are 'medium', 'hd' is 'high'. OpenAI's 'xhigh' and 'max' are refused (400).")
    output_format: str | None = Field(
        default=None, description="The images' file format: 'png' (the default; lossless, the decoder's own bytes), "
        "'jpeg' or 'webp'. OpenAI's 'gif' and 'svg' are refused (400).")
    output_compression: int | None = Field(
        default=None, description="jpeg and webp only: OpenAI's compression level, 0-100, default 100. As OpenAI's "
        "default of 100 implies, higher keeps more of the image (larger files): it is the encoder's quality setting "
        "(Pillow's `quality`). With png only 100 (lossless) is accepted.")
    background: str | None = Field(
        default=None, description="'auto' (the default) or 'opaque': every image is opaque. 'transparent' is "
        "refused (400): no served model draws an alpha channel.")
    user: str | None = Field(
        default=None, description="An end-user id (at most 256 characters): recorded in the log with the request "
        "id; changes nothing.")
    safety_identifier: str | None = Field(
        default=None, description="OpenAI's successor of `user`: recorded the same way (at most 256 characters); "
        "changes nothing.")


class ControlNetInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A served ControlNet of the model (GET /v1/models lists them).")
    image: str = Field(description="The control image (PNG, JPEG or WebP): base64, or a data: URL (in a "
                                   "multipart/form-data body it may come as the file part `controlnets.<i>.image` "
                                   "instead). Resized to the output size as the diffusers ControlNet pipelines "
                                   "resize it.")
    conditioning_scale: float = Field(default=1.0, description="Weight of its residuals (diffusers' "
                                                               "controlnet_conditioning_scale).")
    start: float = Field(default=0.0, description="Fraction of the steps before which it is off "
                                                  "(control_guidance_start).")
    end: float = Field(default=1.0, description="Fraction of the steps after which it is off "
                                                "(control_guidance_end).")


class LoraInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="A served LoRA of the model (GET /v1/models lists them).")
    scale: float = Field(default=1.0, description="Its adapter weight (diffusers' set_adapters weight).")


class ApproximationOptions(BaseModel):
    """The approximations a generation or an edit asks for (stepserve's extensions, README 'Step
    caching' and 'SynerDiff'); omitted, each is its model's setting."""

    step_cache: float | None = Field(
        default=None, description="This request's First-Block Cache threshold: a step whose first-block output "
        "moved less than this (relative mean change) since the request's last computed step reuses that step's "
        "later blocks, inside the same batch as requests that do not. 0 turns it off (exact); omitted: the "
        "model's `step_cache`; above the model's `max_step_cache`, or on a model without it, refused (400).")
    step_cache_method: Literal["first_block", "taylorseer"] | None = Field(
        default=None, description="What a step the cache skips takes: 'first_block', the later blocks' result at "
        "the request's last computed step as it was; 'taylorseer', that result extrapolated to first order from its "
        "last two computed steps. Omitted: the model's `step_cache_method`.")
    skip_cfg_quality: float | None = Field(
        default=None, description="This request's SynerDiff skip-CFG quality S: it runs without its unconditional "
        "row from the first step from which, by its model's measured `skip_cfg_curve`, skipping to the end keeps "
        "the picture at least this similar (SSIM) to the exact one. 1 turns it off (exact); omitted: the model's "
        "`skip_cfg_quality`; below the model's `min_skip_cfg_quality`, or on a model without a curve, refused (400).")


class ImageGenerationRequest(ImageOptions, ApproximationOptions):
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
    slo_s: float | None = Field(default=None, description="Latency objective in seconds from arrival, for SLO-aware "
                                                          "policies; overrides the model's `slo_s`.")
    moderation: Literal["auto", "low"] | None = Field(
        default=None, description="OpenAI's content-moderation level: accepted and recorded (logged, counted); "
                                  "changes nothing here.")
    style: Literal["vivid", "natural"] | None = Field(
        default=None, description="DALL-E 3's style: accepted and recorded (logged, counted); changes nothing here "
                                  "(describe the style in the prompt).")
    controlnets: list[ControlNetInput] | None = Field(
        default=None, description="ControlNets conditioning the image; their residuals are summed in this order.")
    loras: list[LoraInput] | None = Field(default=None, description="LoRAs styling the image.")


class ImageData(BaseModel):
    b64_json: str = Field(description="The image file (in the response's output_format), base64.")
    seed: int = Field(description="The noise seed this image was drawn with.")


class ImagesResponse(BaseModel):
    created: int = Field(description="Unix time (seconds) the response was made.")
    data: list[ImageData] = Field(description="The images, image i drawn with seed + i.")
    output_format: Literal["png", "jpeg", "webp"] = Field(description="The file format of every image in `data`.")
    quality: Literal["low", "medium", "high"] | None = Field(
        description="The quality preset whose steps ran; null when the request's num_inference_steps set them.")
    size: str = Field(description="'WIDTHxHEIGHT' of the images.")
    background: Literal["opaque"] = Field(description="Always 'opaque': no served model draws an alpha channel.")


class ImageEditRequest(ImageOptions, ApproximationOptions):
    """POST /v1/images/edits: repaint the masked part of an image. OpenAI's clients send it as
    multipart/form-data (file parts `image` and `mask`); JSON bodies and handle callers give both
    as base64 instead."""

    model_config = ConfigDict(extra="forbid")

    image: str = Field(description="The image to edit (PNG, JPEG or WebP): base64 or a data: URL; in a form body "
                                   "the file part `image` (or one `image[]`).")
    mask: str = Field(description="A PNG with an alpha channel, as large as the image: its fully transparent pixels "
                                  "mark where to edit (OpenAI's convention). Base64, or the file part `mask`.")
    prompt: str = Field(description="What to draw in the masked area.")
    model: str | None = Field(default=None, description="Served model id; defaults to the first that edits images.")
    n: int = Field(default=1, description="Images to generate; image i uses seed + i.")
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT' of the output, or 'auto' (the image's own "
                                                       "size); the image and mask are resized to it.")
    response_format: Literal["b64_json", "url"] = Field(
        default="b64_json", description="Only b64_json is served; 'url' is rejected with 400.")
    negative_prompt: str | None = Field(default=None, description="What to steer away from (needs CFG).")
    num_inference_steps: int | None = Field(default=None, description="Denoising steps before `strength` cuts them.")
    guidance_scale: float | None = Field(default=None, description="Classifier-free guidance; <= 1 turns CFG off.")
    seed: int | None = Field(default=None, description="Noise seed; random when omitted (returned per image).")
    slo_s: float | None = Field(default=None, description="Latency objective in seconds from arrival, for SLO-aware "
                                                          "policies; overrides the model's `slo_s`.")
    strength: float = Field(default=1.0, description="How far into the noise the image goes, in (0, 1] (the "
                                                     "diffusers inpaint pipelines' strength): below 1 only the last "
                                                     "steps run and more of the image survives under the mask.")
    template_id: str | None = Field(default=None, description="Names the image as a template edited again and again "
                                                              "(letters, digits, '.', '_', '-'): edits of one template "
                                                              "may reuse its cached activations where the server "
                                                              "enables them. A template is its name and its image: "
                                                              "another image under the name is another template.")
    input_fidelity: Literal["high", "low"] | None = Field(
        default=None, description="How closely OpenAI's models keep the input's features: accepted and recorded "
                                  "(logged, counted); changes nothing here (the unmasked area is kept as it is).")
    loras: list[LoraInput] | None = Field(default=None, description="LoRAs styling the edit.")
