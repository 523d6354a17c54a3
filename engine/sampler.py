"""Per-request denoising state, for images and videos alike: its own scheduler, generator and
latents, which can leave a worker between steps and continue on another.

diffusers schedulers keep a step counter (and some keep history), so requests that share a
forward cannot share a scheduler. A `Sampler` replays exactly what its family's pipeline
(`StableDiffusionPipeline`, `WanPipeline`) does for one request, split at the model call so
many requests, or the ranks of a sequence-parallel group, can share it; where the pipelines
differ, the family's hooks (`DiffusionFamily.initial_latents`, `prepare_scheduler`,
`scale_model_input`, `step_kwargs`) say how.

Its whole state exports to a picklable dict of host-memory copies (`state()`), and
`Sampler.from_state` rebuilds it on any worker. Nothing in the state depends on how many ranks
ran the forwards, so a video paused at SP degree d resumes at any other degree, and a resumed
request equals an uninterrupted one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers.configuration_utils import FrozenDict

from stepserve.engine.addon_modes.base import AddonModeName
from stepserve.engine.addons import ControlRows, LoraRows, StepAddons
from stepserve.engine.addons.controlnet import control_tensor
from stepserve.engine.families.base import DiffusionFamily, RowConditioning, TextEmbeddings
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.inpaint import EditLatents, image_tensor, mask_tensor, start_edit
from stepserve.policies.types import RequestSpec


@dataclass(frozen=True)
class RequestInputs:
    """A request's inputs besides its prompts, as the ingress prepared them (uint8 pixels: a
    quarter of the float tensors' bytes): one control image per ControlNet of its spec
    ([H, W, 3], `addons.controlnet.control_pixels`), and an edit's image ([H, W, 3]) and mask
    ([H, W], white: repaint), `engine.inpaint.edit_pixels`. They wait in the object store for
    the worker that admits the request."""

    control: tuple[np.ndarray, ...] = ()
    image: np.ndarray | None = None
    mask: np.ndarray | None = None


@dataclass(frozen=True)
class Conditioning:
    """A request's text embeddings, one text each ([1, ...] per name), negative only when CFG is
    on; one control image (float [1, 3, H, W] in [0, 1], `addons.controlnet.control_tensor`)
    per ControlNet of its spec, in order; and an edit's image (float [1, 3, H, W] in [-1, 1]) and
    mask (float [1, 1, H, W] of 0 and 1), `engine.inpaint.image_tensor` and `mask_tensor`."""

    prompt: TextEmbeddings
    negative: TextEmbeddings | None = None
    control: tuple[torch.Tensor, ...] = ()
    edit: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_numpy(cls, prompt: dict[str, np.ndarray], negative: dict[str, np.ndarray] | None,
                   inputs: RequestInputs | None = None) -> "Conditioning":
        """From the text encoder's arrays and the ingress's `RequestInputs`. Copies: arrays from
        the object store are read-only views of it, and a request keeps its conditioning for its
        whole life (and exports it)."""
        def tensors(arrays: dict[str, np.ndarray]) -> TextEmbeddings:
            return {name: torch.from_numpy(np.array(array)) for name, array in arrays.items()}
        inputs = inputs or RequestInputs()
        edit = None if inputs.image is None else (image_tensor(inputs.image), mask_tensor(inputs.mask))
        return cls(tensors(prompt), None if negative is None else tensors(negative),
                   tuple(control_tensor(pixels) for pixels in inputs.control), edit)


# 2: schedulers restore from their instance dict (no set_timesteps); 3: the text context became
# the per-row conditioning dict; 4: control images and joined LoRAs; 5: edits (their latents, and
# the steps `strength` skips).
STATE_FORMAT = 5


class Sampler:
    def __init__(self, spec: RequestSpec, family: DiffusionFamily, conditioning: Conditioning):
        _check_kind(spec, family)
        self.spec = spec
        self.scheduler = family.make_scheduler()
        family.prepare_scheduler(self.scheduler, spec)
        self.first_step = _first_step(self.scheduler, spec)
        # The pipelines draw the initial noise (and SD every stochastic step) from one CPU
        # generator, so a request's result is the same on any device.
        self.generator = torch.Generator("cpu").manual_seed(spec.seed)
        self.edit: EditLatents | None = None
        # The forward mode whose state it holds, and that state (`engine.forward_modes`: its use
        # of its template's cached activations, its patch cache), if its runner gave it one. Not
        # exported: where it resumes, that worker's modes give it their state anew.
        self.mode: ModeName | None = None
        self.mode_state: Any = None
        if spec.is_edit:
            if conditioning.edit is None:
                raise ValueError(f"request {spec.request_id}: an edit needs its image and mask")
            self.latents, self.edit = start_edit(family, spec, self.scheduler, self.generator, *conditioning.edit,
                                                 self.scheduler.timesteps[self.first_step:])
        else:
            self.latents = family.initial_latents(spec, self.scheduler, self.generator)
        text = _on(conditioning.prompt, family)
        if self.uses_cfg:
            if conditioning.negative is None:
                raise ValueError(f"request {spec.request_id}: CFG needs negative prompt embeddings")
            uncond = _on(conditioning.negative, family)
            if uncond.keys() != text.keys():
                raise ValueError(f"request {spec.request_id}: prompt and negative prompt embeddings differ in kind")
            text = {name: torch.cat([uncond[name], text[name]]) for name in text}  # the pipelines' [uncond, cond]
        self.cond = family.row_conditioning(spec, text)
        self.control = _control_rows(spec, family, conditioning.control)
        # The state each add-on mode keeps for it (`engine.addon_modes`), by mode; not exported.
        self.addon_state: dict[AddonModeName, Any] = {}
        self.loras_joined: dict[str, int] = {}  # LoRA name -> the step from which it applies
        self.step_index = 0
        self._bind(family)

    def _bind(self, family: DiffusionFamily) -> None:
        # The family's per-step hooks, resolved once: a step must cost as little as possible.
        self._scale_model_input = family.scale_model_input
        self._step_kwargs = family.step_kwargs(self.scheduler, self.generator)
        self._noise_image = family.noise_image
        self._timesteps = self.scheduler.timesteps[self.first_step:]

    def enter(self, mode: ModeName, state: Any) -> None:
        """Hold `state` of forward mode `mode` (a request holds one mode's at most)."""
        if self.mode is not None:
            raise ValueError(f"request {self.spec.request_id} already holds the state of forward mode {self.mode.value}")
        self.mode, self.mode_state = mode, state

    def leave(self) -> None:
        """Drop its forward mode's state: its next steps run in whatever mode takes them."""
        self.mode = self.mode_state = None

    # ---- where it stands ----------------------------------------------------------------

    @property
    def uses_cfg(self) -> bool:
        return self.spec.uses_cfg

    @property
    def rows(self) -> int:
        """Rows this request adds to a forward: [uncond, cond] under CFG."""
        return self.spec.rows

    @property
    def timesteps(self) -> torch.Tensor:
        """The timesteps it runs: its scheduler's, less the first ones an edit's `strength` skips."""
        return self._timesteps

    @property
    def steps_total(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.steps_total

    @property
    def uses_addons(self) -> bool:
        """It names ControlNets or LoRAs (only then do add-on modes touch its steps)."""
        return bool(self.spec.controlnets or self.spec.loras)

    @property
    def pending_loras(self) -> list[str]:
        """Its LoRAs that do not apply yet (still loading when it started), in its order."""
        return [use.name for use in self.spec.loras if use.name not in self.loras_joined]

    def lora_deadline(self, join_by: float) -> int:
        """The step by which all its LoRAs must apply when they may join late: the first
        `join_by` of its steps may run without them (bounded asynchronous loading; 0: exact)."""
        return min(int(join_by * self.steps_total), self.steps_total - 1)

    def join_loras(self, names: list[str]) -> None:
        """These LoRAs apply from its next step on."""
        for name in names:
            self.loras_joined.setdefault(name, self.step_index)

    # ---- stepping -----------------------------------------------------------------------

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor, RowConditioning]:
        """(sample, per-row timesteps, conditioning) for this request's rows of the next forward.
        The pipelines run CFG as one forward of two rows (SD) or two forwards (Wan); rows are
        independent, so either way gives the same result."""
        if self.done:
            raise RuntimeError(f"request {self.spec.request_id}: all {self.steps_total} steps are done")
        t = self.timesteps[self.step_index]
        sample = torch.cat([self.latents] * 2) if self.uses_cfg else self.latents
        sample = self._scale_model_input(self.scheduler, sample, t)
        return sample, t.reshape(1).expand(self.rows), self.cond

    def addons(self, first_row: int) -> StepAddons:
        """Its ControlNets and LoRAs at the next step, for its rows starting at `first_row` of a
        forward, exact (the runner's add-on modes may change them: `engine.addon_modes`)."""
        rows = slice(first_row, first_row + self.rows)
        last = self.step_index == self.steps_total - 1
        controls = tuple(ControlRows(use.name, rows, image, use.scale_at(self.step_index, self.steps_total), last=last)
                         for use, image in zip(self.spec.controlnets, self.control))
        loras = tuple(LoraRows(use.name, rows, use.scale) for use in self.spec.loras if use.name in self.loras_joined)
        return StepAddons(controls, loras)

    def advance(self, noise_pred: torch.Tensor) -> None:
        """Take this request's step from its rows of the forward's output."""
        if self.uses_cfg:
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + self.spec.guidance_scale * (cond - uncond)
        t = self.timesteps[self.step_index]
        self.latents = self.scheduler.step(noise_pred, t, self.latents, **self._step_kwargs, return_dict=False)[0]
        self.step_index += 1
        if self.edit is not None:
            next_t = None if self.done else self.timesteps[self.step_index]
            self.latents = self.edit.blend(self._noise_image, self.scheduler, self.latents, next_t)

    @torch.inference_mode()
    def step(self, family: DiffusionFamily, sp_group: Any = None) -> None:
        """One step on its own: forward (sequence-parallel over `sp_group` if given), advance."""
        if self.pending_loras:  # alone, it applies what the family has
            self.join_loras([name for name in self.pending_loras if name in family.loras])
        sample, timesteps, cond = self.model_input()
        addons = self.addons(0)
        extra = {"addons": addons} if addons else {}
        self.advance(family.denoise(sample, timesteps, cond, sp_group=sp_group, **extra))

    # ---- moving between workers ---------------------------------------------------------

    def state(self, device: str | torch.device = "cpu") -> dict[str, Any]:
        """Everything needed to continue this request elsewhere, as copies on `device` (host
        memory by default): spec, step, latents, conditioning, generator position and the
        scheduler. Picklable; independent of this sampler afterwards."""
        device = torch.device(device)
        return {
            "format": STATE_FORMAT,
            "spec": self.spec,
            "step_index": self.step_index,
            "latents": copy_to(self.latents, device),
            "cond": copy_to(self.cond, device),
            "control": copy_to(self.control, device),
            "loras_joined": dict(self.loras_joined),
            "first_step": self.first_step,
            "edit": None if self.edit is None else copy_to(self.edit.tensors(), device),
            "generator_state": self.generator.get_state(),
            "scheduler": scheduler_state(self.scheduler, device, self.latents.device),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], family: DiffusionFamily) -> "Sampler":
        """Rebuild a sampler from `state()` on `family`'s device (any worker, any SP degree); it
        continues exactly where the exported one stopped (same scheduler history, same
        generator position)."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"unsupported sampler state format {state.get('format')!r}")
        self = cls.__new__(cls)
        self.spec = state["spec"]
        _check_kind(self.spec, family)
        self.step_index = state["step_index"]
        self.latents = copy_to(state["latents"], family.device)
        self.cond = {name: value.to(device=family.device, dtype=family.dtype, copy=True)
                     for name, value in state["cond"].items()}
        self.control = tuple(image.to(device=family.device, dtype=family.dtype, copy=True)
                             for image in state["control"])
        self.loras_joined = dict(state["loras_joined"])
        self.first_step = state["first_step"]
        self.edit = None if state["edit"] is None else EditLatents(**copy_to(state["edit"], family.device))
        self.mode = None
        self.mode_state = None
        self.addon_state = {}
        _check_addons(self.spec, family)
        self.generator = torch.Generator("cpu")
        self.generator.set_state(state["generator_state"])
        self.scheduler = restore_scheduler(state["scheduler"], family.device)
        self._bind(family)
        return self


def _on(embeddings: TextEmbeddings, family: DiffusionFamily) -> TextEmbeddings:
    return {name: value.to(device=family.device, dtype=family.dtype) for name, value in embeddings.items()}


def _first_step(scheduler: Any, spec: RequestSpec) -> int:
    """Where its timesteps start: an edit skips the first ones its `strength` leaves out, and
    tells its scheduler so (the inpaint pipelines' `get_timesteps`, `set_begin_index` included)."""
    if not spec.is_edit:
        return 0
    first = spec.skip_steps * scheduler.order
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(first)
    return first


def _check_kind(spec: RequestSpec, family: DiffusionFamily) -> None:
    if spec.is_edit and not family.edits:
        raise ValueError(f"model {family.source.name!r} ({family.source.family}) does not edit images")
    if spec.kind.lane is not family.kind:
        raise ValueError(f"request {spec.request_id} is {spec.kind.value}, but model {family.source.name!r} "
                         f"generates {family.kind.value}")
    if spec.uses_cfg and not family.classifier_free_guidance:
        # Its rows would be [uncond, cond] where the model expects one guided row.
        raise ValueError(f"request {spec.request_id} asks for classifier-free guidance, but model "
                         f"{family.source.name!r} is guidance-distilled (its spec must say cfg=False)")


def _check_addons(spec: RequestSpec, family: DiffusionFamily) -> None:
    if not (spec.controlnets or spec.loras):
        return
    if not family.takes_addons:
        raise ValueError(f"model {family.source.name!r} ({family.source.family}) takes no ControlNets or LoRAs")
    # (Whether its LoRAs are loaded is the step runner's to check: they may arrive later.)
    missing = sorted({use.name for use in spec.controlnets} - set(family.controlnets))
    if missing and family.controlnet_service is None:  # (the service knows its own)
        raise ValueError(f"ControlNet {missing} not loaded for model {family.source.name!r}")


def _control_rows(spec: RequestSpec, family: DiffusionFamily, images: tuple[torch.Tensor, ...]) -> tuple:
    """One control image per ControlNet of `spec`, repeated for each of its rows (the pipelines'
    `prepare_image` under CFG), on the family's device and dtype."""
    _check_addons(spec, family)
    if len(images) != len(spec.controlnets):
        raise ValueError(f"request {spec.request_id}: {len(spec.controlnets)} ControlNets but {len(images)} "
                         "control images")
    rows = []
    for use, image in zip(spec.controlnets, images):
        if tuple(image.shape) != (1, 3, spec.height, spec.width):
            raise ValueError(f"request {spec.request_id}: control image for {use.name!r} is "
                             f"{tuple(image.shape)}, not (1, 3, {spec.height}, {spec.width})")
        rows.append(torch.cat([image] * spec.rows).to(device=family.device, dtype=family.dtype))
    return tuple(rows)


def scheduler_state(scheduler: Any, device: torch.device, home: torch.device) -> dict[str, Any]:
    """A scheduler's whole state as copies on `device`. `home` is the device its sampler runs
    on: tensors kept elsewhere on purpose (UniPC keeps its sigmas on the host to avoid syncs)
    are remembered, so a restore puts every tensor back where its kind belongs."""
    attrs = {k: v for k, v in vars(scheduler).items() if k != "_internal_dict"}
    return {
        "class": type(scheduler).__name__,
        "config": dict(scheduler.config),
        # The whole instance dict: step counter, sigmas/timesteps, and any multistep history
        # (UniPC's model_outputs, timestep_list, last_sample, lower_order_nums...).
        "attrs": {k: copy_to(v, device) for k, v in attrs.items()},
        "off_home": sorted(k for k, v in attrs.items() if isinstance(v, torch.Tensor) and v.device != home),
    }


def restore_scheduler(saved: dict[str, Any], device: torch.device) -> Any:
    """The scheduler `scheduler_state` saved, for a sampler on `device`.

    Rebuilt from its saved instance dict rather than `from_config` + `set_timesteps`: every
    attribute is in the state, and parsing a diffusers config costs milliseconds, which would
    dominate a resume (GenServe budgets it at a small fraction of one step).
    """
    scheduler_cls = getattr(diffusers, saved["class"], None)
    if scheduler_cls is None:
        raise ValueError(f"unknown scheduler class {saved['class']!r} in sampler state")
    scheduler = scheduler_cls.__new__(scheduler_cls)
    scheduler._internal_dict = FrozenDict(saved["config"])
    off_home = set(saved["off_home"])
    for name, value in saved["attrs"].items():
        vars(scheduler)[name] = copy_to(value, "cpu" if name in off_home else device)
    return scheduler


def copy_to(value: Any, device: torch.device | str) -> Any:
    """A deep copy with every tensor moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, copy=True)
    if isinstance(value, (list, tuple)):
        return type(value)(copy_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: copy_to(v, device) for k, v in value.items()}
    return copy.deepcopy(value)
