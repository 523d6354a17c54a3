"""Edits of a template with cached activations, through the step runner: the first edit of a
template records its activations (and is exact), later ones compute only their masked tokens."""

import numpy as np
import pytest

from stepserve.actors.activation_cache import ActivationCache
from stepserve.engine.editing.masked_sd3 import CacheKind, cache_slots
from stepserve.engine.mode_settings import ModeSettings
from stepserve.engine.step_runner import StepRunner
from stepserve.engine.template_edits import TemplateCache, template_key
from stepserve.policies.types import RequestSpec, StepGroup, WorkerPlan

from tests.cpu.engine.test_edit_golden import edit_admission, edit_spec


def templated(spec: RequestSpec, template: str = "sofa") -> RequestSpec:
    return RequestSpec(**{**spec.__dict__, "template_id": template})


def run(runner: StepRunner, family, specs_inputs, rounds: int = 40) -> dict[str, np.ndarray]:
    """Everyone admitted at once, one group, stepped to the end."""
    admissions = {spec.request_id: edit_admission(family, spec, inputs) for spec, inputs in specs_inputs}
    left = {spec.request_id: spec.steps_to_run for spec, _ in specs_inputs}
    done, admit = {}, tuple(admissions)
    for rnd in range(rounds):
        if not left:
            break
        finish = tuple(rid for rid in left if left[rid] == 1)
        plan = WorkerPlan("w0", admit=admit, groups=(StepGroup(tuple(left)),), finish=finish, plan_id=rnd)
        report, payloads = runner.execute(plan, admissions if admit else {})
        assert not report.failed, report.failed
        admit = ()
        for rid in list(left):
            left[rid] -= 1
        done.update(zip(finish, payloads))
        for rid in finish:
            del left[rid]
    return done


@pytest.fixture
def store():
    return ActivationCache(memory_bytes=256 << 20)


@pytest.fixture(params=list(CacheKind))
def kind(request):
    return request.param


def test_the_first_edit_records_exactly_and_a_later_one_reuses_the_record(tiny_sd3, store, kind, monkeypatch):
    runner = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3},
                        modes=ModeSettings(templates=TemplateCache(store, kind)))
    exact = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3})
    first, first_in = edit_spec(tiny_sd3, "a", seed=1, size=128, box=(32, 32, 80, 64))
    recorded = run(runner, tiny_sd3, [(templated(first), first_in)])
    np.testing.assert_array_equal(recorded["a"], run(exact, tiny_sd3, [(first, first_in)])["a"])
    record = store.get(template_key(templated(first), kind))
    slots = cache_slots(tiny_sd3.denoiser, kind)
    assert sorted(record) == sorted(f"{s}.{b}" for s in range(first.steps_to_run) for b in range(slots))
    assert record["0.0"].shape[0] == 2 and (128 // 16) ** 2 in record["0.0"].shape

    masked_calls = []
    original = type(tiny_sd3).denoise_masked
    monkeypatch.setattr(type(tiny_sd3), "denoise_masked",
                        lambda self, *args: masked_calls.append(args[3].index.shape) or original(self, *args))
    # The same edit again reuses a record of its own inputs: exact still.
    again = run(runner, tiny_sd3, [(templated(RequestSpec(**{**first.__dict__, "request_id": "b"})), first_in)])
    np.testing.assert_allclose(again["b"], recorded["a"], atol=1e-5, rtol=1e-4)
    # Another prompt, seed and a smaller mask: close to its exact edit, not equal, and cheaper.
    other, other_in = edit_spec(tiny_sd3, "c", seed=2, size=128, box=(40, 40, 72, 56), prompt="a green chair")
    cached = run(runner, tiny_sd3, [(templated(other), other_in)])["c"]
    exact_other = run(exact, tiny_sd3, [(other, other_in)])["c"]
    assert 0 < np.abs(cached - exact_other).max() and np.abs(cached - exact_other).mean() < 0.5 * np.abs(exact_other).mean()
    tokens = (128 // 16) ** 2
    assert masked_calls and all(rows == 2 and width < tokens / 2 for rows, width in masked_calls)


def test_template_edits_batch_together_and_a_mixed_group_falls_back_to_exact(tiny_sd3, store, kind):
    runner = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3},
                        modes=ModeSettings(templates=TemplateCache(store, kind)))
    exact = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3})
    a, a_in = edit_spec(tiny_sd3, "a", seed=1, size=64)
    run(runner, tiny_sd3, [(templated(a), a_in)])
    b, b_in = edit_spec(tiny_sd3, "b", seed=2, size=64, box=(0, 0, 16, 16))
    c, c_in = edit_spec(tiny_sd3, "c", seed=3, size=64, box=(16, 16, 64, 64))
    together = run(runner, tiny_sd3, [(templated(b), b_in), (templated(c), c_in)])
    alone = {spec.request_id: run(runner, tiny_sd3, [(templated(RequestSpec(**{**spec.__dict__})), inputs)])[
        spec.request_id] for spec, inputs in ((b, b_in), (c, c_in))}
    for rid in "bc":  # padding the shorter mask changes nothing
        np.testing.assert_allclose(together[rid], alone[rid], atol=1e-5, rtol=1e-4)
    # Beside an edit of no template, everyone runs exact (and records nothing).
    d, d_in = edit_spec(tiny_sd3, "d", seed=4, size=64)
    mixed = run(runner, tiny_sd3, [(templated(b), b_in), (d, d_in)])
    np.testing.assert_allclose(mixed["b"], run(exact, tiny_sd3, [(b, b_in)])["b"], atol=1e-5, rtol=1e-4)


def test_each_report_counts_the_blocks_its_masked_forwards_loaded_and_computed(tiny_sd3, store, kind):
    """The loading DP on the worker: measured costs where computing the first block in full wins
    (outputs: one block loaded, one computed per step); a keys-values record loads every slot."""
    from stepserve.engine.editing.loading_plan import LoadingPlanner
    from stepserve.policies.instgenie.pipeline_dp import Loading
    from stepserve.policies.types import EditBlockCounts

    from tests.cpu.engine.editing.test_loading_plan import measured

    first, first_in = edit_spec(tiny_sd3, "a", seed=1, size=64)
    # The edit's share lies between the measured 1/16 and 1, where C_w runs up to C_wo: at it the
    # optimum still computes the first block in full and loads the second.
    costs = measured((0.0, 0.0), (0.011, 0.011), (0.010, 0.010), share=1 / 16, model=tiny_sd3.source.name)
    runner = StepRunner("w0", {tiny_sd3.source.name: tiny_sd3},
                        modes=ModeSettings(templates=TemplateCache(store, kind,
                                                                   LoadingPlanner(Loading.OPTIMAL, costs))))
    run(runner, tiny_sd3, [(templated(first), first_in)])  # records: exact, no masked forward
    again = templated(RequestSpec(**{**first.__dict__, "request_id": "b"}))
    plan = WorkerPlan("w0", admit=("b",), groups=(StepGroup(("b",)),), plan_id=100)
    report, _ = runner.execute(plan, {"b": edit_admission(tiny_sd3, again, first_in)})
    assert not report.failed
    slots = cache_slots(tiny_sd3.denoiser, kind)
    expected = EditBlockCounts(loaded=1, computed=1) if kind is CacheKind.OUTPUTS else EditBlockCounts(loaded=slots)
    assert report.edit_blocks == expected
    plan = WorkerPlan("w0", groups=(StepGroup(("b",)),), steps=2, plan_id=101)
    assert runner.execute(plan, {})[0].edit_blocks == EditBlockCounts(*(2 * n for n in vars(expected).values()))
