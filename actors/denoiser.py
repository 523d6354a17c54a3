"""The denoiser worker: one per GPU (or N on CPU), holding denoisers and running plans.

A plain class; `actors.pool` turns it into an addressable Ray actor. The router sends it one
`WorkerPlan` per round (`execute`), images and videos alike; a video's forward may run
sequence-parallel with other workers of the same `SPWorld`. `interrupt` runs in a concurrency
group of its own (`CONTROL`), beside a running plan, so the router can cut a plan of several
steps short at its next step boundary; `decoded` in another (`DECODE`), where a chunked decode
(`vae_decoder.chunks`) runs beside the plans. Latents stay on the worker between
steps: they leave only as an exported or checkpointed state (host memory, handed on as an
object ref), a finished image's latents (its PNG when the worker decodes images), or a finished
video's frames.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from uuid import uuid4

import ray
import torch

from stepserve.actors.activation_cache import ActivationCache
from stepserve.actors.activation_store import StoreActivations, node_store
from stepserve.actors.controlnet_client import ServiceControlNets
from stepserve.actors.lora_store import StoreLoras
from stepserve.actors.node_stores import stores_by_node
from stepserve.actors.sp_world import DEFAULT_TIMEOUT_S, SPWorld, backend_for, rendezvous
from stepserve.actors.worker_options import WorkerPoolSpec, WorkerServices
from stepserve.engine.addons.controlnet import RemoteControlNets
from stepserve.engine.addons.lora import LoraLoader
from stepserve.engine.addons.source import AddonKind, load_addon
from stepserve.engine.decode_lane import DecodeLane, PendingDecode
from stepserve.engine.families import (DENOISER, TEXT, VAE, DiffusionFamily, ModelSource, family_class, load_family,
                                      resolve_device)
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.patch_cache.calibration import calibrate
from stepserve.engine.round_sequencer import RoundSequencer
from stepserve.engine.sampler import Conditioning
from stepserve.engine.step_runner import Admission, StepRunner
from stepserve.engine.template_edits import TemplateCache
from stepserve.engine.text_encoding import CachedTextEncoder, Pair, encode_items, text_item
from stepserve.policies.types import RequestFailure, RequestSpec, StepReport, WorkerPlan
from stepserve.routing.core import AdmissionRef

CONTROL = "control"  # the concurrency group of the calls that must not wait for a running plan
DECODE = "decode"  # the concurrency group in which images decode in chunks beside the plans

# Errors that mean an input's producer (a worker, the text encoder, or the ref's owner) died:
# the request is resumed from its last checkpoint, not failed.
LOST = (
    ray.exceptions.ObjectLostError,
    ray.exceptions.OwnerDiedError,
    ray.exceptions.ReferenceCountingAssertionError,
    ray.exceptions.RayActorError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.ObjectFetchTimedOutError,
)


def worker_parts(source: ModelSource, decode_images: bool = False, encode_text: bool = False,
                 patch_cache: bool = False) -> set[str]:
    """A model whose requests decode where they were denoised loads its VAE here too: a video
    family's always, an image model's when the worker decodes images; and a model that edits
    images, whose worker encodes an edit's image when it admits it (as it may its prompts); its
    text encoders when the worker encodes prompts, or calibrates the patch cache of a family that
    has one (its calibration generations encode their prompts)."""
    parts = {DENOISER}
    family = family_class(source.family)
    if decode_images or family.decode_on_worker or family.edits:
        parts.add(VAE)
    if encode_text or (patch_cache and ModeName.PATCH_CACHE in family.forward_modes):
        parts.add(TEXT)
    return parts


class DenoiserWorker:
    def __init__(self, worker_id: str, models: Sequence[ModelSource], options: WorkerPoolSpec = WorkerPoolSpec(),
                 services: WorkerServices = WorkerServices()):
        """`options.encode_text`: this worker encodes the prompts of what it admits, keeping
        `text_cache_size` embeddings (else the text encoder deployment does). `addons`: the
        ControlNets it holds and the LoRAs it serves; LoRAs come from `services.lora_stores` (this
        node's, or any) as requests need them, or, with no store, are all loaded here at start.
        `services.controlnet_service`: the ControlNet deployment, which then runs the ControlNets
        instead of this worker. `edit_cache` (with `services.activation_stores`), `patch_cache`,
        `pack_resolutions`, `lora_join_by` and `controlnet_stale`: its forward and add-on modes
        (`mode_settings`)."""
        o = options
        if o.torch_threads:
            torch.set_num_threads(o.torch_threads)
        self.device = resolve_device(o.device)
        controlnets = services.controlnet_service
        # One client of the ControlNet service, handed to each family that takes add-ons as it is built.
        remote = None if controlnets is None else RemoteControlNets(ServiceControlNets(controlnets))
        families = {m.name: load_family(m, worker_parts(m, o.decode_images, o.encode_text, o.patch_cache is not None),
                                        self.device, remote if family_class(m.family).takes_addons else None)
                    for m in models}
        loras = None
        if services.lora_stores:
            store = stores_by_node(services.lora_stores, ray.get_runtime_context().get_node_id())
            loras = StoreLoras(store, families, o.max_resident_loras)
        for addon in o.addons:
            here = loras is None if addon.kind is AddonKind.LORA else controlnets is None
            if here:
                load_addon(addon, families[addon.model])
        self.text = CachedTextEncoder(families, o.text_cache_size) if o.encode_text else None
        # New on every process start: a restarted actor has lost every resident request.
        self.incarnation = uuid4().hex
        chunked = o.decode_images and (o.decode_chunks > 1 or o.sequencer is not None)
        self.lane = DecodeLane(o.decode_chunks) if chunked else None
        sequencer = None
        if o.sequencer is not None and self.lane is not None:
            sequencer = RoundSequencer(o.sequencer.tables, o.sequencer.alpha, o.sequencer.controller)
        self.runner = StepRunner(worker_id, families, self.incarnation, decode_images=o.decode_images,
                                 decode_lane=self.lane, sequencer=sequencer,
                                 modes=mode_settings(o, families, services, loras))
        self.sp_world: SPWorld | None = None
        self._interrupted = 0  # the plan id the router last asked to cut short
        self._held_since: float | None = None  # when the last plan ended with requests resident

    def ready(self) -> str:
        """This process's incarnation (see `StepReport.incarnation`)."""
        return self.incarnation

    def execute(self, plan: WorkerPlan, admissions: tuple[AdmissionRef, ...] = ()) -> StepReport | tuple[Any, ...]:
        """Run one plan. `admissions` has one `AdmissionRef` per id of `plan.admit`.

        Returns the `StepReport` alone when `plan.outputs` is empty, else `(report, *payloads)`,
        one payload per id of `plan.outputs` (call it with `num_returns=1 + len(plan.outputs)`).
        """
        waited = None if self._held_since is None else time.perf_counter() - self._held_since
        resolved, unresolved = self._resolve(admissions)
        report, payloads = self.runner.execute(plan, resolved, sp_group=self._sp_group,
                                               stop=lambda: self._interrupted == plan.plan_id)
        # The runner saw no admission for the unresolved; say why. One copy of the report a plan.
        failed = tuple(unresolved.get(f.request_id, f) for f in report.failed) if unresolved else report.failed
        report = replace(report, failed=failed, waited_s=waited)
        self._held_since = time.perf_counter() if self.runner.resident else None
        if self.lane is not None:  # the router awaits the decode's own call for the PNG
            me = ray.get_runtime_context().current_actor
            payloads = [me.decoded.remote(p.request_id) if isinstance(p, PendingDecode) else p for p in payloads]
        return (report, *payloads) if plan.outputs else report

    @ray.method(concurrency_group=DECODE)
    def decoded(self, rid: str) -> bytes:
        """The PNG of image `rid`, which a plan finished and left decoding in chunks (`PendingDecode`)."""
        return self.lane.wait(rid)

    @ray.method(concurrency_group=CONTROL)
    def interrupt(self, plan_id: int) -> None:
        """End plan `plan_id` after the step it is running (its report says how many ran). A plan
        that already ended, or another plan, is not affected."""
        self._interrupted = plan_id  # one int: read by the plan's thread between steps

    def _resolve(self, refs: tuple[AdmissionRef, ...]) -> tuple[dict[str, Admission], dict[str, RequestFailure]]:
        """Every ref's value in one `ray.get`, and the prompts to encode here in one batch; a
        bad ref or prompt fails only its own request."""
        here = [ref for ref in refs if ref.source is None and not ref.resume]
        values = dict(zip((ref.spec.request_id for ref in here), self._encode([ref.spec for ref in here])))
        values.update(_fetch([ref for ref in refs if ref.source is not None or ref.resume]))
        with_inputs = [ref for ref in refs if ref.inputs is not None and not ref.resume]
        inputs = _fetch([replace(ref, source=ref.inputs) for ref in with_inputs])
        resolved: dict[str, Admission] = {}
        unresolved: dict[str, RequestFailure] = {}
        for ref in refs:
            rid = ref.spec.request_id
            value, extra = values[rid], inputs.get(rid)
            what = "state unavailable" if ref.resume else "text encoding failed"
            if isinstance(extra, Exception):
                value, what = extra, "image inputs unavailable"
            if isinstance(value, Exception):
                unresolved[rid] = RequestFailure(rid, f"{what}: {_reason(value)}", lost=isinstance(value, LOST))
                continue
            try:
                if ref.resume:
                    resolved[rid] = Admission(ref.spec, state=value)
                else:
                    resolved[rid] = Admission(ref.spec, conditioning=Conditioning.from_numpy(*value, extra))
            except Exception as exc:
                unresolved[rid] = RequestFailure(rid, f"admission failed: {_reason(exc)}", lost=False)
        return resolved, unresolved

    def _encode(self, specs: list[RequestSpec]) -> list[Pair | Exception]:
        """The prompts of the fresh starts this worker admits with no embeddings ref."""
        if not specs:
            return []
        if self.text is None:
            error = RuntimeError(f"worker {self.runner.worker_id} does not encode prompts (text_encoder.on_workers "
                                 f"is off) and got no embeddings")
            return [error] * len(specs)
        return encode_items(self.text, [text_item(spec) for spec in specs])

    # ---- sequence-parallel world --------------------------------------------------------

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()

    def sp_rendezvous(self, one_node: bool) -> str:
        """Where the SP world's members meet (`sp_world.rendezvous`), made on this worker's node:
        ask the worker that will be rank 0. `one_node`: every member runs on this node."""
        return rendezvous(one_node)

    def join_sp_world(self, init_method: str, rank: int, world_size: int,
                      timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Blocks until all ranks have joined: call it on every worker concurrently."""
        if self.sp_world is not None:
            raise RuntimeError(f"worker {self.runner.worker_id} already joined an SP world as rank "
                               f"{self.sp_world.rank}")
        self.sp_world = SPWorld.join(init_method, rank, world_size, backend_for(self.device), timeout_s)

    def leave_sp_world(self) -> None:
        if self.sp_world is not None:
            self.sp_world.close()
            self.sp_world = None

    def _sp_group(self, ranks: tuple[int, ...]) -> Any | None:
        """The process group of `ranks` (world ranks); a 1-tuple is this worker alone and needs
        no world."""
        if self.sp_world is None:
            if len(ranks) != 1:
                raise RuntimeError(f"worker {self.runner.worker_id} has not joined an SP world; cannot run over "
                                   f"ranks {ranks}")
            return None
        return self.sp_world.group(ranks)


def mode_settings(options: WorkerPoolSpec, families: Mapping[str, DiffusionFamily], services: WorkerServices,
                  loras: LoraLoader | None = None) -> ModeSettings:
    """The settings of the worker's forward and add-on modes from the pool's options: where
    edits of templates find cached activations (this node's activation store, behind an LRU of
    the records this worker used last), the patch cache's predictor of each model that has one
    (calibrated here, now), whether plain groups pack resolutions, what brings LoRAs (`loras`,
    None: all are loaded at start) and how late each may join, and whether ControlNets the
    service runs may be one step stale."""
    templates = None
    if services.activation_stores:
        local = ActivationCache(options.edit_cache_worker_bytes) if options.edit_cache_worker_bytes else None
        templates = TemplateCache(StoreActivations(node_store(services.activation_stores), local),
                                  options.edit_cache_kind, options.edit_cache_loading)
    patch_reuse = {}
    if options.patch_cache is not None:
        patch_reuse = {name: calibrate(family, name, options.patch_cache) for name, family in families.items()
                       if ModeName.PATCH_CACHE in family.forward_modes}
    return ModeSettings(templates, patch_reuse, options.pack_resolutions, loras, options.lora_bounds,
                        options.controlnet_stale)


def _fetch(refs: list[AdmissionRef]) -> dict[str, Any]:
    """Each ref's value, or the exception fetching it raised, by request id: all in one
    `ray.get`, or, if that fails, one by one, so a bad ref fails only its own request."""
    try:
        values = ray.get([ref.source for ref in refs]) if refs else []
    except Exception:
        values = [_fetch_one(ref.source) for ref in refs]
    return {ref.spec.request_id: value for ref, value in zip(refs, values)}


def _fetch_one(source: Any) -> Any:
    try:
        return ray.get(source)
    except Exception as exc:
        return exc


def _reason(exc: Exception) -> str:
    # A task's own exception, not Ray's wrapper (whose text is the whole remote traceback).
    cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
    return f"{type(cause).__name__}: {cause}"
