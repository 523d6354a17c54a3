"""Golden: a worker that packs resolutions (`StepRunner(pack_resolutions=True)`) runs a plan's
one-size groups of a model as one forward a step (SD1.5 and SDXL: the patched UNet; SD3: packed
tokens), each request still equal to its diffusers pipeline alone with the same seed; groups
that must stay apart (other models, LoRAs, a family that cannot pack) do; off, each group is its
own forward."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.types import LoraUse, StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, solo_pipeline_image


class Forwards:
    """Counts a family's forwards: plain (`denoise`) and packed (`denoise_mixed`)."""

    def __init__(self, family, monkeypatch):
        self.plain = self.packed = 0
        denoise, mixed = family.denoise, getattr(family, "denoise_mixed", None)

        def counted_denoise(*args, **kwargs):
            self.plain += 1
            return denoise(*args, **kwargs)

        monkeypatch.setattr(family, "denoise", counted_denoise)
        if mixed is not None:
            def counted_mixed(*args, **kwargs):
                self.packed += 1
                return mixed(*args, **kwargs)

            monkeypatch.setattr(family, "denoise_mixed", counted_mixed)


def run_plans(family, specs, pack: bool, steps: int):
    """Every spec admitted in the first plan, one group per spec, `steps` one-step plans; the
    finished latents by id."""
    runner = StepRunner("w0", {family.source.name: family}, modes=ModeSettings(pack_resolutions=pack))
    admissions = {s.request_id: admission_for(family, s) for s in specs}
    groups = tuple(StepGroup((s.request_id,)) for s in specs)
    done = {}
    for step in range(steps):
        finish = tuple(s.request_id for s in specs) if step == steps - 1 else ()
        plan = WorkerPlan("w0", admit=tuple(admissions) if step == 0 else (), groups=groups, finish=finish,
                          plan_id=step)
        report, payloads = runner.execute(plan, admissions if step == 0 else {})
        assert not report.failed, report.failed
        done.update(zip(finish, payloads))
    return done


@pytest.mark.parametrize("name", ["tiny_family", "tiny_sdxl", "tiny_sd3"])
def test_one_forward_a_step_and_each_equals_its_pipeline(name, request, monkeypatch):
    family = request.getfixturevalue(name)
    model = family.source.name
    specs = [make_spec("s", steps=3, seed=1, size=64, model=model),
             make_spec("l", steps=3, seed=2, size=128, model=model, prompt="a lighthouse at dusk"),
             replace(make_spec("w", steps=3, seed=3, size=64, model=model, negative="blurry"), width=96)]
    forwards = Forwards(family, monkeypatch)
    finished = run_plans(family, specs, pack=True, steps=3)
    assert (forwards.packed, forwards.plain) == (3, 0)
    for spec in specs:
        image = family.decode(torch.from_numpy(finished[spec.request_id]))[0]
        np.testing.assert_allclose(image, solo_pipeline_image(family, spec), atol=3e-5, err_msg=spec.request_id)


def test_off_each_group_is_its_own_forward(tiny_family, monkeypatch):
    specs = [make_spec("a", steps=2, size=64), make_spec("b", steps=2, size=128)]
    forwards = Forwards(tiny_family, monkeypatch)
    run_plans(tiny_family, specs, pack=False, steps=2)
    assert (forwards.packed, forwards.plain) == (0, 4)


def test_groups_that_must_stay_apart_do(tiny_family):
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, modes=ModeSettings(pack_resolutions=True))
    specs = [make_spec("a", size=64), make_spec("b", size=128), make_spec("c", size=96),
             replace(make_spec("styled", size=64), loras=(LoraUse("x"),)), make_spec("split", size=64)]
    runner.samplers = {s.request_id: _Resident(s) for s in specs}
    groups = (StepGroup(("a",)), StepGroup(("styled",)), StepGroup(("b", "c")), StepGroup(("split",), ranks=(0, 1)),
              StepGroup(("gone",)))
    assert joined(runner, groups) == [StepGroup(("a", "b", "c")), StepGroup(("styled",)),
                                      StepGroup(("split",), ranks=(0, 1)), StepGroup(("gone",))]


def test_sizes_a_unet_cannot_patch_stay_apart(tiny_family):
    """A patch must stay whole at the UNet's deepest level: odd latent sides share no such patch."""
    assert tiny_family.packs([(4, 8, 8), (4, 16, 12)])
    assert not tiny_family.packs([(4, 8, 8), (4, 9, 9)])
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, modes=ModeSettings(pack_resolutions=True))
    runner.samplers = {"a": _Resident(make_spec("a", size=64)), "odd": _Resident(make_spec("odd", size=72))}
    assert joined(runner, (StepGroup(("a",)), StepGroup(("odd",)))) == [StepGroup(("a",)), StepGroup(("odd",))]


def test_a_family_without_mixed_resolutions_refuses_a_mixed_group(tiny_flux, monkeypatch):
    # Every image family packs now; this Flux instance is made one that cannot (video families cannot).
    monkeypatch.setattr(tiny_flux, "forward_modes", frozenset())
    monkeypatch.setattr(tiny_flux, "packs", lambda sizes: False)
    specs = [make_spec("a", steps=2, size=64, model="tiny-flux"), make_spec("b", steps=2, size=32, model="tiny-flux")]
    runner = StepRunner("w0", {"tiny-flux": tiny_flux}, modes=ModeSettings(pack_resolutions=True))
    admissions = {s.request_id: admission_for(tiny_flux, s) for s in specs}
    report, _ = runner.execute(WorkerPlan("w0", admit=tuple(admissions), groups=(StepGroup(("a", "b")),)),
                               admissions)
    assert {f.request_id for f in report.failed} == {"a", "b"}
    assert all("cannot mix latent shapes" in f.message for f in report.failed)
    assert joined(runner, (StepGroup(("a",)), StepGroup(("b",)))) == [StepGroup(("a",)), StepGroup(("b",))]


def joined(runner: StepRunner, groups) -> list[StepGroup]:
    """The groups the runner steps for a plan's `groups` (its packed mode joins them)."""
    return runner.modes[ModeName.PACKED].joined(groups, runner.samplers, runner.families)


class _Resident:
    """A resident request as the packed mode's joining reads it: its spec, latents and forward mode."""

    def __init__(self, spec):
        self.spec = spec
        self.latents = torch.zeros(1, 4, spec.height // 8, spec.width // 8)
        self.mode = None
