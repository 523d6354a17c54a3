"""SwiftDiffusion's bounded asynchronous LoRA loading (§4.2): a request may be admitted before
its LoRAs are on the worker; each joins it from the first step after it has arrived, and by its
deadline at the latest (a step waits for it there). With a bound of 0 the deadline is the first
step: exact, the LoRA only loads beside other requests' steps. Without a loader every LoRA a
request names must be loaded already.

The mode keeps no state of its own per request: which LoRA applies from which step is part of
what the request computed, so it travels with the request (`Sampler.loras_joined`) and a request
moved to another worker goes on with the same joins."""

from __future__ import annotations

import time

from stepserve.engine.addon_modes.base import AddonMode, AddonModeName
from stepserve.engine.addons.lora import LoraLoader
from stepserve.engine.addons.source import LoraJoinBounds


class LoraJoining(AddonMode):
    name = AddonModeName.LORA_JOINING

    def __init__(self, loader: LoraLoader | None = None, bounds: LoraJoinBounds = LoraJoinBounds()):
        """`loader`: brings LoRAs that are not in the families yet (None: every LoRA must be
        loaded already); `bounds`: the fraction of a request's steps that may run before each
        of its LoRAs has arrived."""
        self.loader = loader
        self.bounds = bounds
        self._polled = False
        self._waited_s = 0.0  # in `prepare`: the whole forward waits meanwhile

    def admit(self, sampler, family) -> None:
        """Starts bringing the LoRAs it names that are not here."""
        missing = [use.name for use in sampler.spec.loras if use.name not in family.loras]
        if missing and self.loader is None:
            raise ValueError(f"LoRA {missing} not loaded for model {family.source.name!r}")
        for name in missing:
            self.loader.request(sampler.spec.model, name)

    def begin_forward(self) -> None:
        self._polled = False

    def prepare(self, sampler, family) -> None:
        """Its LoRAs for the next step: the joined ones must be here (it may have moved from
        another worker); pending ones join once here, and by its deadline at the latest. What
        has arrived is added first, once a forward."""
        if not sampler.spec.loras:
            return
        started = time.perf_counter()
        try:
            self._bring_joined_and_due(sampler, family)
        finally:
            self._waited_s += time.perf_counter() - started

    def _bring_joined_and_due(self, sampler, family) -> None:
        model, loader = sampler.spec.model, self.loader
        if loader is not None:
            if not self._polled:
                loader.poll()
                self._polled = True
            for name in sampler.loras_joined:
                if name not in family.loras:
                    loader.wait(model, name)
        pending = sampler.pending_loras
        if pending and loader is not None:
            for name in pending:  # each LoRA by its own bound
                if name not in family.loras and sampler.step_index >= sampler.lora_deadline(
                        self.bounds.bound(model, name)):
                    loader.wait(model, name)
        sampler.join_loras([name for name in pending if name in family.loras])

    def trim(self, resident) -> None:
        """Let the loader drop LoRAs no resident request uses (`resident`: their samplers)."""
        if self.loader is not None:
            self.loader.trim({(s.spec.model, use.name) for s in resident for use in s.spec.loras})

    def take_wait(self) -> float:
        """Seconds forwards waited for LoRAs since the last call (a plan's `lora_wait_s`)."""
        waited, self._waited_s = self._waited_s, 0.0
        return waited
