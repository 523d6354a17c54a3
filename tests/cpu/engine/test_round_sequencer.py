"""SynerDiff's sequencer on a worker (`engine.round_sequencer`): a group's step split into the
planner's sub-rounds, each member stepping once, the decodes and skip-CFG shared out as the plan
says; exact where nothing skips, and the decodes' PNGs the whole decodes'."""

import dataclasses

import pytest

from stepserve.engine.decode_lane import DecodeLane
from stepserve.engine.round_sequencer import RoundSequencer, load_controller
from stepserve.engine.step_runner import StepRunner
from stepserve.policies.synerdiff import ConcurrencyTable, Round
from stepserve.policies.synerdiff.contention import concurrency_table
from stepserve.policies.types import StepGroup, WorkerPlan

from tests.tiny import admission_for, make_spec, run_together

# Splitting finishes the decodes sooner (0.05 and 0.25 s against 0.25 and 0.25 s) but takes longer
# (0.4 s against 0.3 s): the throughput slack alpha decides.
SPLITTING = ConcurrencyTable({
    Round(1, 0, 0): (0.1, 0.0), Round(2, 0, 0): (0.12, 0.0), Round(1, 1, 0): (0.2, 0.05),
    Round(2, 1, 0): (0.15, 0.1), Round(2, 2, 0): (0.3, 0.25), Round(0, 1, 0): (0.05, 0.05),
    Round(0, 2, 0): (0.1, 0.1)}, chunks=2, max_batch=2)


TINY = ("tiny-sd", 64, 64)  # make_spec's model and size


class Resident:  # what the sequencer reads of a resident request
    mode = None
    step_index = 0

    def __init__(self, size: int = 64):
        self.spec = make_spec("r", size=size)


def test_a_step_splits_into_sub_rounds_that_share_the_decodes():
    sequencer = RoundSequencer({TINY: SPLITTING}, alpha=1.0)
    subs = sequencer.sub_rounds(StepGroup(("a", "b")), {"a": Resident(), "b": Resident()}, decodes=2)
    assert [s.group.request_ids for s in subs] == [("a",), ("b",)] and [s.decodes for s in subs] == [1, 1]
    tight = RoundSequencer({TINY: SPLITTING}, alpha=0.2)  # too little slack: the one coarse round
    (one,) = tight.sub_rounds(StepGroup(("a", "b")), {"a": Resident(), "b": Resident()}, decodes=2)
    assert one.group.request_ids == ("a", "b") and one.decodes == 2
    (lone,) = sequencer.sub_rounds(StepGroup(("a",)), {"a": Resident()}, decodes=3)
    assert lone.decodes == 3  # more decodes than members ride along
    (over,) = sequencer.sub_rounds(StepGroup(("a", "b", "c")), dict.fromkeys("abc", Resident()), decodes=1)
    assert over.group.request_ids == ("a", "b", "c")  # beyond the table's B_max: unsplit


def test_each_group_is_planned_on_its_own_models_table_at_its_size():
    sequencer = RoundSequencer({TINY: SPLITTING}, alpha=1.0)
    # Another size has no table here, and a group of two sizes no one table: each runs as one round.
    for residents in ({"a": Resident(128), "b": Resident(128)}, {"a": Resident(), "b": Resident(128)}):
        (one,) = sequencer.sub_rounds(StepGroup(("a", "b")), residents, decodes=2)
        assert one.group.request_ids == ("a", "b") and one.decodes == 2
    both = RoundSequencer({TINY: SPLITTING, ("tiny-sd", 128, 128): SPLITTING}, alpha=1.0)
    subs = both.sub_rounds(StepGroup(("a", "b")), {"a": Resident(128), "b": Resident(128)}, decodes=2)
    assert [s.group.request_ids for s in subs] == [("a",), ("b",)]


def derived(chunks: int, batch: int = 4) -> dict:
    return {TINY: concurrency_table(lambda m, k: 0.01 * (2 * m - k) + 0.02, 0.03, chunks, batch, batch)}


def test_sequenced_steps_are_the_plain_steps_and_decodes_are_whole(tiny_family):
    specs = [make_spec(r, steps=3, seed=i) for i, r in enumerate("abc")]
    lane = DecodeLane(chunks=2, idle_s=0.0)
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, decode_lane=lane,
                        sequencer=RoundSequencer(derived(2), alpha=1.0))
    pending, _ = run_together(runner, tiny_family, specs, 3, (StepGroup(("a", "b", "c")),))
    whole, _ = run_together(StepRunner("w1", {"tiny-sd": tiny_family}, decode_images=True), tiny_family, specs, 3,
                            (StepGroup(("a", "b", "c")),))
    assert all(lane.wait(rid) == whole[rid] for rid in pending)


def test_the_sequencer_chooses_who_skips_cfg(tiny_family):
    spec = dataclasses.replace(make_spec("s", steps=4, seed=2), skip_cfg_from=0.0)
    sequencer = RoundSequencer(derived(2, batch=2), alpha=1.0)
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, decode_lane=DecodeLane(2, idle_s=0.0),
                        sequencer=sequencer)
    chosen, states = run_together(runner, tiny_family, [spec], 4)
    assert states["s"].chosen  # with nothing else to plan, skipping makes the round fastest: it skips
    plain = StepRunner("w1", {"tiny-sd": tiny_family}, decode_images=True)
    alone, _ = run_together(plain, tiny_family, [spec], 4)
    assert runner.decode_lane.wait("s") == alone["s"]


def test_a_sequencer_needs_a_lane(tiny_family):
    with pytest.raises(ValueError, match="decode_lane"):
        StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, sequencer=RoundSequencer({TINY: SPLITTING}))
    with pytest.raises(ValueError, match="alpha"):
        RoundSequencer({TINY: SPLITTING}, alpha=-0.1)


def test_the_profile_reaches_the_workers(tmp_path):
    from stepserve.deployments.config import AppConfig

    def write(name: str, model: str, size: int, header: str = "model,height,width,") -> str:
        rounds = ("2,1,0,0,0.1,0", "2,1,1,0,0.12,0.05", "2,0,1,0,0.05,0.05")
        prefix = f"{model},{size},{size}," if header else ""
        path = tmp_path / name
        path.write_text(f"{header}chunks,unet,vae,skip,tau_s,delta_s\n" + "".join(f"{prefix}{r}\n" for r in rounds))
        return str(path)

    profile = write("concurrency.csv", "a", 64)
    base = {"models": [{"name": "a", "preset": "tiny"}]}
    config = AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 2,
                                                               "sequencer_profile": profile}})
    spec = config.pool_spec().sequencer
    ((key, table),) = spec.tables.items()
    assert key == ("a", 64, 64) and table.has(Round(1, 1, 0)) and table.chunks == 2 and spec.alpha == 0.1
    assert spec.controller is None
    larger = write("larger.csv", "a", 128)  # one table a size
    both = AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 2,
                                                             "sequencer_profile": [profile, larger]}})
    assert set(both.pool_spec().sequencer.tables) == {("a", 64, 64), ("a", 128, 128)}
    for profiles, error in (([profile, profile], "measured by another profile"),
                            ([write("old.csv", "a", 64, header="")], "missing columns"),
                            ([write("b.csv", "b", 64)], "model 'b'.*not served")):
        with pytest.raises(ValueError, match=error):
            AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 2,
                                                              "sequencer_profile": profiles}})
    controlled = AppConfig.model_validate({**base, "vae_decoder": {
        "on_workers": True, "chunks": 2, "sequencer_profile": profile, "load_controller": True,
        "controller_window": 3, "max_chunks": 4}}).pool_spec().sequencer.controller
    assert controlled == load_controller(2, 4, 3) and controlled.chunk_levels == (2, 3, 4)
    with pytest.raises(ValueError, match="needs sequencer_profile"):
        AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "load_controller": True}})
    with pytest.raises(ValueError, match="below chunks"):
        AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 2, "load_controller": True,
                                                          "sequencer_profile": profile, "max_chunks": 1}})
    with pytest.raises(ValueError, match="needs load_controller"):
        AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "max_chunks": 2}})
    with pytest.raises(ValueError, match="measured at 2 chunks"):
        AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 3,
                                                          "sequencer_profile": profile}})
    with pytest.raises(ValueError, match="sequencer_profile"):
        AppConfig.model_validate({**base, "vae_decoder": {"on_workers": True, "chunks": 2,
                                                          "sequencer_profile": str(tmp_path / "missing.csv")}})


def test_the_load_controller_moves_skip_cfg_then_chunks_and_back():
    sequencer = RoundSequencer({TINY: SPLITTING}, controller=load_controller(2, 3, window=2))
    seen = []
    for queued in (0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 9, 9, 0, 0, 0, 0, 0):
        sequencer.observe(queued)
        seen.append((round(sequencer.load, 2), sequencer.chunks))
    # Each growth over a window moves one notch: skip-CFG starts first, then the chunks; as the
    # queue falls (or stays empty), the chunks come back first.
    assert seen == [(0, 2), (0.33, 2), (0.33, 2), (0.67, 2), (0.67, 2), (1, 2), (1, 2), (1, 3), (1, 3), (1, 3),
                    (1, 3), (1, 2), (1, 2), (0.67, 2), (0.67, 2), (0.33, 2), (0.33, 2), (0, 2)]
    assert RoundSequencer({TINY: SPLITTING}).chunks is None and RoundSequencer({TINY: SPLITTING}).load == 0


def test_under_load_a_request_skips_cfg_from_nearer_its_floor(tiny_family):
    """A request whose own S never skips (0.9 of 6 steps) and whose floor skips from 0.3: its
    worker's queue grows plan after plan, the controller moves its start two notches (to 0.5,
    step 3) by its fourth step and to its floor by its sixth: it then denoises as a request skipping
    from step 3 does with no controller (step 2 comes too late to change anything)."""
    spec = dataclasses.replace(make_spec("s", steps=6, seed=4), skip_cfg_from=0.9, skip_cfg_floor_from=0.3)
    assert spec.skip_cfg_step is None and spec.skip_cfg_step_under(1.0) == 2
    lane = DecodeLane(2, idle_s=0.0)
    runner = StepRunner("w0", {"tiny-sd": tiny_family}, decode_images=True, decode_lane=lane,
                        sequencer=RoundSequencer(derived(2, batch=2), alpha=1.0,
                                                 controller=load_controller(2, 2, window=2)))
    admission = {"s": admission_for(tiny_family, spec)}
    reported = []
    for step, queued in enumerate((0, 5, 10, 15, 20, 25)):
        plan = WorkerPlan("w0", admit=("s",) if step == 0 else (), groups=(StepGroup(("s",)),),
                          finish=("s",) if step == 5 else (), plan_id=step, queued=queued)
        report, _ = runner.execute(plan, admission if step == 0 else {})
        assert not report.failed
        reported.append((round(report.load_control[0], 2), report.load_control[1]))
    assert reported == [(0, 2), (0.33, 2), (0.33, 2), (0.67, 2), (0.67, 2), (1, 2)]  # what the router publishes
    from_half = dataclasses.replace(spec, skip_cfg_from=0.5, skip_cfg_floor_from=None)
    alone, _ = run_together(StepRunner("w1", {"tiny-sd": tiny_family}, decode_images=True), tiny_family,
                            [from_half], 6)
    exact, _ = run_together(StepRunner("w2", {"tiny-sd": tiny_family}, decode_images=True), tiny_family,
                            [dataclasses.replace(spec, skip_cfg_from=1.0, skip_cfg_floor_from=None)], 6)
    assert lane.wait("s") == alone["s"] != exact["s"]
