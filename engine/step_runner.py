"""Executes one `WorkerPlan` on the requests resident on one worker: images and videos alike.

The runner owns the samplers of its resident requests and never decides what runs; the router
does, one plan per round. A plan runs, in order: drop, admit, one denoiser forward per group
(sequence-parallel when the group names ranks) `plan.steps` times over, export, checkpoint,
finish, release. How a group's forward runs is the first of the runner's forward modes that
takes it (`engine.forward_modes`: packed resolutions, a CFG split, a template edit, the patch
cache, step caching, skip-CFG, else the plain forward); what each member adds to it is its exact
add-ons as the runner's add-on modes adjust them (`engine.addon_modes`: LoRAs that join late,
stale ControlNets). Both kinds of mode give admitted requests their per-request state. Between
two of those steps `stop` may cut the plan short (the router wants the worker back: a request
arrived or was cancelled); a request it was to finish then stays resident.

Every failure is confined to the requests it concerns, reported in the `StepReport`, and a
failed request is forgotten here (the router resumes it from a checkpoint or fails it). After a
sequence-parallel step every member of the group holds an identical full copy of the request
(Ulysses hands every rank the whole output), so any one of them can export or finish it while
the others release theirs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from stepserve.engine.addon_modes.base import AddonModeName
from stepserve.engine.addon_modes.registry import addon_modes
from stepserve.engine.addons import StepAddons
from stepserve.engine.decode_lane import DecodeLane, PendingDecode
from stepserve.engine.families.base import DiffusionFamily
from stepserve.engine.forward_modes.base import ForwardBatch, ForwardMode, ModeName
from stepserve.engine.forward_modes.registry import forward_modes
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.png import encode_png
from stepserve.engine.round_sequencer import RoundSequencer
from stepserve.engine.sampler import Conditioning, Sampler
from stepserve.policies.types import (
    EditBlockCounts,
    RequestFailure,
    RequestProgress,
    RequestSpec,
    StepGroup,
    StepReport,
    WorkerPlan,
)


@dataclass(frozen=True)
class Admission:
    """What a worker needs to make a request resident: its spec and either its text
    conditioning (a fresh start) or the state another worker exported (a resume)."""

    spec: RequestSpec
    conditioning: Conditioning | None = None
    state: dict[str, Any] | None = None


class StepRunner:
    def __init__(self, worker_id: str, families: Mapping[str, DiffusionFamily], incarnation: str = "",
                 decode_images: bool = False, decode_lane: DecodeLane | None = None,
                 sequencer: RoundSequencer | None = None, modes: ModeSettings = ModeSettings()):
        """`decode_images`: a finished image leaves as its PNG, decoded by this worker's VAE, not as
        its latents (`vae_decoder.on_workers`); with a `decode_lane`, as a `PendingDecode` whose PNG
        the lane decodes in chunks beside the next rounds (SynerDiff's VAE chunking). A video
        always leaves decoded (`decode_on_worker`). `sequencer` (with a lane): SynerDiff's, which
        splits each step of a group into sub-rounds, each with its share of the lane's decodes
        and its choice of skip-CFG, and whose load controller, if it has one, follows the queue
        each plan carries (`engine.round_sequencer`).
        `modes`: the settings of its forward and add-on modes (`engine.forward_modes`,
        `engine.addon_modes`); by default every mode runs exactly, and groups as planned."""
        self.worker_id = worker_id
        self.families = dict(families)
        self.incarnation = incarnation
        if decode_lane is not None and not decode_images:
            raise ValueError("a decode lane decodes images on the worker: it needs decode_images")
        self.decode_images = decode_images
        if sequencer is not None and decode_lane is None:
            raise ValueError("a sequencer orders a decode lane's chunks: it needs a decode_lane")
        self.decode_lane = decode_lane
        self.sequencer = sequencer
        self.addon_modes = addon_modes(modes)
        self._loras = self.addon_modes[AddonModeName.LORA_JOINING]
        self.modes = forward_modes(modes)
        self._packed = self.modes[ModeName.PACKED]
        self.samplers: dict[str, Sampler] = {}
        self._cuda_devices = {f.device for f in self.families.values() if f.device.type == "cuda"}

    @property
    def resident(self) -> tuple[str, ...]:
        """Resident request ids, in admission order."""
        return tuple(self.samplers)

    @torch.inference_mode()
    def execute(
        self,
        plan: WorkerPlan,
        admissions: Mapping[str, Admission],
        sp_group: Callable[[tuple[int, ...]], Any] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> tuple[StepReport, list[Any]]:
        """Run `plan`. `admissions` holds an `Admission` for each id in `plan.admit`; `sp_group`
        maps a group's world ranks to its process group (None for this worker alone); `stop`,
        asked before each step after the first, ends the plan's steps early when it says so.

        Returns the report and one payload per id of `plan.outputs`, in that order: an export's
        or a checkpoint's state (host-memory copies), a finished image's latents (float32
        [1, C, h, w]) or a finished video's frames (uint8 [F, H, W, 3]); None where it failed,
        or where the plan was cut short before the request's last step. A finished image is its
        PNG instead of its latents when the runner decodes images (a `PendingDecode` with a lane).
        """
        start = time.perf_counter()
        run = _PlanRun(self)
        if self.sequencer is not None:
            self.sequencer.observe(plan.queued)
        for rid in plan.drop:
            self.samplers.pop(rid, None)
        for rid in plan.admit:
            run.admit(rid, admissions.get(rid))
        groups = self._packed.joined(plan.groups, self.samplers, self.families)
        steps_run = 0
        for _ in range(plan.steps):
            if steps_run and stop is not None and stop():
                break
            if self.sequencer is not None:
                self._sequenced_step(run, groups, sp_group)
            else:
                if self.decode_lane is not None and groups:
                    self.decode_lane.round()
                for group in groups:
                    run.step(group, sp_group)
            steps_run += 1
        cut = steps_run < plan.steps
        # What stepped (or was admitted) stands here now, also for those that leave below.
        progress = {rid: RequestProgress(rid, s.step_index, s.steps_total)
                    for rid in run.touched if (s := self.samplers.get(rid)) is not None}
        payloads = [run.export(rid) for rid in plan.export]
        payloads += [run.checkpoint(rid) for rid in plan.checkpoint]
        payloads += [run.finish(rid, cut) for rid in plan.finish]
        for rid in plan.release:
            self.samplers.pop(rid, None)
        self._loras.trim(self.samplers.values())
        for device in self._cuda_devices:  # kernels are asynchronous; count them in the plan's time
            torch.cuda.synchronize(device)
        report = StepReport(
            worker_id=self.worker_id,
            plan_id=plan.plan_id,
            progress=tuple(p for rid, p in progress.items() if rid not in run.failed),
            failed=tuple(run.failed.values()),
            duration_s=time.perf_counter() - start,
            batch_size=len(plan.stepping),
            incarnation=self.incarnation,
            steps_run=steps_run if cut else None,
            lora_wait_s=self._loras.take_wait(),
            edit_blocks=self._edit_blocks(),
            load_control=None if self.sequencer is None else self.sequencer.load_control,
        )
        return report, payloads

    def _edit_blocks(self) -> EditBlockCounts:
        """What this plan's masked forwards of template edits loaded and computed (none without
        the template-edit mode)."""
        edits = self.modes.get(ModeName.TEMPLATE_EDIT)
        return EditBlockCounts() if edits is None else edits.tally.take()

    def _sequenced_step(self, run: _PlanRun, groups, sp_group) -> None:
        """One step of every group, each as its sequencer's sub-rounds; the lane's decodes ride
        with the first group's."""
        decodes = len(self.decode_lane.pending)
        for group in groups:
            for sub in self.sequencer.sub_rounds(group, self.samplers, decodes):
                self.sequencer.choose(sub, self.samplers)
                self.decode_lane.round(sub.decodes)
                run.step(sub.group, sp_group)
            decodes = 0


class _PlanRun:
    """One plan's ops on a runner, with what they touched and what failed (a failed request
    is forgotten at once and skipped by the plan's later ops)."""

    def __init__(self, runner: StepRunner):
        self.runner = runner
        self.samplers = runner.samplers
        self.touched: dict[str, None] = {}  # admitted or stepped, in order
        self.failed: dict[str, RequestFailure] = {}

    def fail(self, rid: str, message: str, lost: bool) -> None:
        self.failed.setdefault(rid, RequestFailure(rid, message, lost))
        self.samplers.pop(rid, None)

    def resident(self, rid: str) -> Sampler | None:
        """The request's sampler, or None (reported as lost) if its state is not here."""
        if rid in self.failed:
            return None
        sampler = self.samplers.get(rid)
        if sampler is None:
            self.fail(rid, f"request {rid} is not resident on worker {self.runner.worker_id}", lost=True)
        return sampler

    def family(self, spec: RequestSpec) -> DiffusionFamily:
        family = self.runner.families.get(spec.model)
        if family is None:
            raise ValueError(f"model {spec.model!r} is not loaded on worker {self.runner.worker_id}")
        return family

    # ---- the ops --------------------------------------------------------------------------

    def admit(self, rid: str, admission: Admission | None) -> None:
        try:
            if admission is None:
                raise ValueError("the plan admits it but no admission was given")
            spec = admission.spec
            if spec.request_id != rid:
                raise ValueError(f"the admission is for request {spec.request_id}")
            if rid in self.samplers:
                raise ValueError(f"it is already resident on worker {self.runner.worker_id}")
            if (admission.conditioning is None) == (admission.state is None):
                raise ValueError("an admission carries either conditioning or a state")
            family = self.family(spec)
            if admission.state is not None:
                if admission.state.get("spec") != spec:
                    raise ValueError("the state is another request's")
                sampler = Sampler.from_state(admission.state, family)
            else:
                sampler = Sampler(spec, family, admission.conditioning)
            for addon_mode in self.runner.addon_modes.values():
                if addon_mode.serves(family):
                    addon_mode.admit(sampler, family)
            for mode in self.runner.modes.values():  # (the first to give it state wins)
                if sampler.mode is None and mode.serves(family):
                    mode.admit(sampler, family)
        except Exception as exc:  # one bad admission must not take the worker (or the plan) down
            self.fail(rid, f"admission failed: {type(exc).__name__}: {exc}", lost=False)
            return
        self.samplers[rid] = sampler
        self.touched[rid] = None

    def step(self, group: StepGroup, sp_group: Callable[[tuple[int, ...]], Any] | None) -> None:
        """One forward for the group's resident members; each advances one step."""
        members: list[tuple[str, Sampler, tuple]] = []
        addon_modes = self.runner.addon_modes.values()
        for addon_mode in addon_modes:
            addon_mode.begin_forward()
        for rid in group.request_ids:
            sampler = self.resident(rid)
            if sampler is None:
                continue
            try:
                if sampler.uses_addons:  # (the step loop: most members have none)
                    family = self.family(sampler.spec)
                    for addon_mode in addon_modes:
                        if addon_mode.serves(family):
                            addon_mode.prepare(sampler, family)
                members.append((rid, sampler, sampler.model_input()))
            except Exception as exc:
                self.fail(rid, f"denoising step failed: {type(exc).__name__}: {exc}", lost=False)
        if not members:
            return
        try:
            batch, mode = self._mode(group, members, sp_group)
        except Exception as exc:
            for rid, _, _ in members:
                self.fail(rid, f"denoising step refused: {type(exc).__name__}: {exc}", lost=False)
            return
        modes = self.runner.modes
        try:
            if group.ranks and sp_group is not None:
                batch = replace(batch, process_group=sp_group(group.ranks))
            for sampler in batch.samplers:
                if sampler.mode is not None and sampler.mode is not mode.name:
                    modes[sampler.mode].missed(sampler)
            outputs = mode.forward(batch)
        except Exception as exc:
            # Over ranks, a forward fails mostly because a partner died or never came: the
            # request's state is then only as good as its last checkpoint.
            for rid, _, _ in members:
                self.fail(rid, f"denoising step failed: {type(exc).__name__}: {exc}", lost=bool(group.ranks))
            return
        for (rid, sampler, _), rows in zip(members, outputs):
            try:
                sampler.advance(rows)
                if sampler.mode is not None:
                    modes[sampler.mode].stepped(sampler)
            except Exception as exc:
                self.fail(rid, f"denoising step failed: {type(exc).__name__}: {exc}", lost=False)
                continue
            self.touched[rid] = None

    def _mode(self, group: StepGroup, members: list[tuple[str, Sampler, tuple]],
              sp_group: Callable[[tuple[int, ...]], Any] | None) -> tuple[ForwardBatch, ForwardMode]:
        """The group's forward (its process group still to come), and the first of the runner's
        modes that takes it, once the group is known to be runnable."""
        samplers = [sampler for _, sampler, _ in members]
        models = sorted({sampler.spec.model for sampler in samplers})
        if len(models) > 1:
            raise ValueError(f"one forward cannot mix models {models}")
        if len(group.ranks) > 1 and len(group.request_ids) != 1:
            raise ValueError(f"a group split over ranks holds one request, not {len(group.request_ids)}")
        batch = ForwardBatch(group, self.family(samplers[0].spec), tuple(samplers),
                             tuple(model_input for _, _, model_input in members), None,
                             _group_addons(samplers, self.runner.addon_modes.values()))
        mode = next(mode for mode in self.runner.modes.values() if mode.takes(batch))
        mode.check(batch)
        if len(group.ranks) > 1 and sp_group is None:
            raise ValueError(f"worker {self.runner.worker_id} has no process groups (ranks {group.ranks})")
        return batch, mode

    def export(self, rid: str) -> dict[str, Any] | None:
        state = self._state(rid, "export")
        self.samplers.pop(rid, None)
        return state

    def checkpoint(self, rid: str) -> dict[str, Any] | None:
        return self._state(rid, "checkpoint")

    def _state(self, rid: str, op: str) -> dict[str, Any] | None:
        sampler = self.resident(rid)
        if sampler is None:
            return None
        try:
            return sampler.state("cpu")  # `.to("cpu")` waits for the device
        except Exception as exc:
            self.fail(rid, f"{op} failed: {type(exc).__name__}: {exc}", lost=False)
            return None

    def finish(self, rid: str, cut: bool) -> np.ndarray | bytes | PendingDecode | None:
        """Its output, and it leaves; if the plan was `cut` short before its last step, it stays."""
        sampler = self.resident(rid)
        if sampler is None or (cut and not sampler.done):
            return None
        try:
            if not sampler.done:
                raise ValueError(f"{sampler.steps_total - sampler.step_index} of its {sampler.steps_total} steps "
                                 "are left; only a fully denoised request finishes")
            family = self.family(sampler.spec)
            if family.decode_on_worker:
                output = _decode_video(family, sampler.latents)
            elif self.runner.decode_lane is not None:
                _check_vae(family)
                sequencer = self.runner.sequencer
                chunks = None if sequencer is None else sequencer.chunks
                output = self.runner.decode_lane.start(rid, family, sampler.latents, chunks)
            elif self.runner.decode_images:
                output = _decode_png(family, sampler.latents)
            else:
                output = sampler.latents.float().cpu().numpy()
        except Exception as exc:
            self.fail(rid, f"finish failed: {type(exc).__name__}: {exc}", lost=False)
            return None
        self.samplers.pop(rid, None)
        return output


def _group_addons(samplers: list[Sampler], modes) -> StepAddons:
    """The forward's add-ons: each member's at the rows it has in the concatenated batch, as
    the add-on modes that hold its state adjust them."""
    controls, loras, first_row = [], [], 0
    for sampler in samplers:
        if sampler.uses_addons:
            mine = sampler.addons(first_row)
            for mode in modes:
                if mode.name in sampler.addon_state:
                    mine = mode.adjust(sampler, mine)
            controls += mine.controls
            loras += mine.loras
        first_row += sampler.rows
    return StepAddons(tuple(controls), tuple(loras))


def _decode_png(family: DiffusionFamily, latents: torch.Tensor) -> bytes:
    """An image's PNG, decoded by this worker's VAE exactly as the VAE decoder deployment does."""
    _check_vae(family)
    return encode_png(family.decode(latents.float())[0])


def _decode_video(family: DiffusionFamily, latents: torch.Tensor) -> np.ndarray:
    """A video's frames, uint8 [F, H, W, 3], decoded by this worker's VAE."""
    _check_vae(family)
    video = family.decode(latents)[0]
    # Rounded as diffusers' `numpy_to_pil` rounds (the frames are already clamped to [0, 1]).
    return (video * 255).round().astype(np.uint8)


def _check_vae(family: DiffusionFamily) -> None:
    if getattr(family, "vae", None) is None:
        raise ValueError(f"model {family.source.name!r} has no VAE loaded on this worker")
