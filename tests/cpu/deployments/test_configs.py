"""Every shipped Serve config is a valid app config, and so is every model example that
configs/cluster.yaml carries commented out (docs that drift from the schema fail here)."""

import re

import pytest
import yaml

from stepserve.deployments.config import AppConfig, ModelConfig
from stepserve.engine.families import FAMILIES
from stepserve.runtime import CONFIGS, load_serve_config

SHIPPED = sorted(path.name for path in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_validate(name, monkeypatch):
    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")  # cluster.yaml reads its keys from there
    (app,) = load_serve_config(CONFIGS / name)["applications"]
    config = AppConfig.model_validate(app["args"])
    assert config.models and all(model.family in FAMILIES for model in config.models)


def test_cluster_model_examples_validate():
    # The commented `models` entries: "# - name: ..." and their "#   key: value" lines.
    lines = (CONFIGS / "cluster.yaml").read_text().splitlines()
    example = [re.sub(r"^(\s*)# ", r"\1", line) for line in lines if re.match(r"^\s*# (- name:|  \w+:)", line)]
    models = [ModelConfig.model_validate(entry) for entry in yaml.safe_load("\n".join(example))]
    (app,) = load_serve_config(CONFIGS / "cluster.yaml")["applications"]
    served = {entry["family"] for entry in app["args"]["models"]}
    assert served == {"sdxl", "sd3", "wan-ti2v"}  # the design: images, template edits, videos
    assert {model.family for model in models} | served == set(FAMILIES)  # every family has an entry


def test_max_size_must_fit_a_dit_positional_table(tmp_path):
    # tiny-sd3's table covers 32 patches of 2 latents of 8 px a side: 512 px.
    assert ModelConfig(name="m", family="sd3", preset="tiny", max_size=512).max_size == 512
    with pytest.raises(ValueError, match="max_size 1024 exceeds the 512 px sides model 'm' can denoise"):
        ModelConfig(name="m", family="sd3", preset="tiny", max_size=1024)
    assert FAMILIES["sd3"].max_side(ModelConfig(name="m", family="sd3", preset="full").to_source()) == 6144
    # A folder on another node cannot be read at config load: the limit is then unknown, not an error.
    assert ModelConfig(name="m", family="sd3", path=str(tmp_path / "elsewhere"), max_size=8192).max_size == 8192


@pytest.mark.parametrize("family, default_size, problem", [
    ("wan-ti2v", "48x48", "multiples of 32"),  # TI2V-5B's sides
    ("sd3", "72x72", "multiples of 16"),
    ("sd15", "2048x2048", "sides from 64 to 512 px"),
])
def test_default_size_must_be_one_the_model_accepts(family, default_size, problem):
    # Else every request that leaves out `size` would get a 400.
    with pytest.raises(ValueError, match=f"default_size: .*{problem}"):
        ModelConfig(name="m", family=family, preset="tiny", default_size=default_size, max_size=512)


def test_the_addon_settings_reach_the_router_as_cost_and_batching_choices():
    from stepserve.policies.addon_costs import ControlNetPlacement
    from stepserve.policies.types import LoraBatching

    base = {"models": [{"name": "m", "family": "sd15", "preset": "tiny"}]}
    plain = AppConfig.model_validate(base)
    assert plain.controlnet_service.placement is ControlNetPlacement.INLINE
    assert plain.lora_loading.batches is LoraBatching.MIXED
    config = AppConfig.model_validate({**base, "controlnet_service": {"enabled": True},
                                       "lora_loading": {"batches": "per_adapter"}})
    assert config.controlnet_service.placement is ControlNetPlacement.SERVICE
    assert config.lora_loading.batches is LoraBatching.PER_ADAPTER
    stale = AppConfig.model_validate({**base, "controlnet_service": {"enabled": True, "stale": True}})
    assert stale.controlnet_service.placement is ControlNetPlacement.STALE
    with pytest.raises(ValueError, match="batches"):
        AppConfig.model_validate({**base, "lora_loading": {"batches": "one_by_one"}})


def test_a_loras_own_join_bound_reaches_the_workers_and_the_router():
    base = {"models": [{"name": "m", "family": "sd15", "preset": "tiny"}], "lora_loading": {"join_by": 0.3},
            "loras": [{"name": "ink", "model": "m", "preset": "tiny", "join_by": 0.0},
                      {"name": "papercut", "model": "m", "preset": "tiny"}]}
    bounds = AppConfig.model_validate(base).pool_spec().lora_bounds
    assert bounds.bound("m", "ink") == 0.0 and bounds.bound("m", "papercut") == 0.3
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="join_by"):
            AppConfig.model_validate({**base, "loras": [{"name": "ink", "model": "m", "preset": "tiny", "join_by": bad}]})
    with pytest.raises(ValueError, match="join_by"):  # a ControlNet never joins late
        AppConfig.model_validate({**base, "controlnets": [{"name": "c", "model": "m", "preset": "tiny", "join_by": 0.1}]})


def test_the_edit_loading_dp_reaches_the_workers_with_the_profiles_block_costs(tmp_path):
    from stepserve.engine.editing.masked_sd3 import CacheKind
    from stepserve.policies.cost_model import BLOCK_CACHED, BLOCK_FULL, BLOCK_LOAD, ProfileRow, write_profile
    from stepserve.policies.instgenie.pipeline_dp import Loading

    base = {"models": [{"name": "m", "family": "sd3", "preset": "tiny", "max_size": 512}]}
    planner = AppConfig.model_validate({**base, "edit_cache": {"enabled": True}}).pool_spec().edit_cache_loading
    assert planner.loading is Loading.ALGORITHM1 and planner.costs is None  # keys_values: every slot loads
    profile = tmp_path / "blocks.csv"
    write_profile(profile, [ProfileRow("m", "cpu", component, 64, 64, 2, 1, 1.0, 3, "measured", mask_ratio=ratio,
                                       slot=slot)
                            for component, ratio in ((BLOCK_CACHED, 0.25), (BLOCK_FULL, 1.0), (BLOCK_LOAD, 1.0))
                            for slot in range(2)])
    outputs = {**base, "router": {"profiles": [str(profile)]},
               "edit_cache": {"enabled": True, "cache": "outputs", "loading": "optimal"}}
    planner = AppConfig.model_validate(outputs).pool_spec().edit_cache_loading
    assert planner.loading is Loading.OPTIMAL and planner.costs.at("m", 64, 64, 2, 0.25) is not None
    assert planner.use_cache(CacheKind.OUTPUTS, 2, "m", 64, 64, 2, 0.25)[1]
    for bad in ("naive", "ideal", "fastest"):
        with pytest.raises(ValueError, match="edit_cache.loading .* is not a way to serve; one of"):
            AppConfig.model_validate({**base, "edit_cache": {"enabled": True, "loading": bad}})


def test_a_relative_weights_path_resolves_from_here_else_under_configs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = ModelConfig(name="shapes", family="sd15", path="models/shapes/sd")
    assert shipped.to_source().path == str(CONFIGS / "models" / "shapes" / "sd")
    (tmp_path / "mine").mkdir()
    assert ModelConfig(name="m", family="sd15", path="mine").to_source().path == str(tmp_path / "mine")
    # Nowhere: left as given, for loading to say it does not exist.
    assert ModelConfig(name="m", family="sd15", path="nowhere").to_source().path == "nowhere"


def test_skip_cfg_needs_a_measured_curve_and_a_cfg_model():
    curve = [[0.5, 0.93], [0.7, 0.955], [0.9, 0.985]]
    model = ModelConfig(name="sd", preset="tiny", default_size="64x64", skip_cfg_quality=0.95, skip_cfg_curve=curve)
    assert model.skip_cfg_from() == 0.7
    assert ModelConfig(name="sd", preset="tiny", default_size="64x64", skip_cfg_quality=0.99,
                       skip_cfg_curve=curve).skip_cfg_from() == 1.0  # a quality the curve never meets
    assert ModelConfig(name="sd", preset="tiny", default_size="64x64", skip_cfg_curve=curve).skip_cfg_from() == 1.0
    with pytest.raises(ValueError, match="needs the model's measured skip_cfg_curve"):
        ModelConfig(name="sd", preset="tiny", default_size="64x64", skip_cfg_quality=0.95)
    with pytest.raises(ValueError, match="does not guide by CFG"):
        ModelConfig(name="f", family="flux", preset="tiny", default_size="64x64", skip_cfg_quality=0.95,
                    skip_cfg_curve=curve)
    with pytest.raises(ValueError):  # fractions must increase
        ModelConfig(name="sd", preset="tiny", default_size="64x64", skip_cfg_curve=[[0.7, 0.9], [0.5, 0.95]])


def test_a_request_to_a_skipping_model_carries_its_first_step():
    from stepserve.deployments.validation import to_specs

    config = AppConfig.model_validate({"models": [
        {"name": "a", "preset": "tiny", "default_size": "64x64", "skip_cfg_quality": 0.95,
         "skip_cfg_curve": [[0.7, 0.955]]},
        {"name": "b", "preset": "tiny", "default_size": "64x64"}]})
    (a,) = to_specs({"prompt": "p", "model": "a", "num_inference_steps": 10}, config, "r1")
    (b,) = to_specs({"prompt": "p", "model": "b", "num_inference_steps": 10}, config, "r2")
    assert (a.skip_cfg_from, a.skip_cfg_step) == (0.7, 7) and (b.skip_cfg_from, b.skip_cfg_step) == (1.0, None)


def test_chunked_decodes_run_on_the_workers():
    with pytest.raises(ValueError, match="needs vae_decoder.on_workers"):
        AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny"}], "vae_decoder": {"chunks": 3}})
    config = AppConfig.model_validate({"models": [{"name": "a", "preset": "tiny"}],
                                       "vae_decoder": {"on_workers": True, "chunks": 3}})
    assert config.pool_spec().decode_chunks == 3


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_cover_every_served_model(name, monkeypatch):
    """A policy that predicts step times prices every model it serves (configs/cluster.yaml's
    composed policy from the measured H200 profile)."""
    from stepserve.policies.cost_model import load_profile

    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")
    (app,) = load_serve_config(CONFIGS / name)["applications"]
    config = AppConfig.model_validate(app["args"])
    if config.router.profiles:
        assert {m.name for m in config.models} <= set(load_profile(*config.router.profiles).models)


def test_the_cluster_runs_the_composed_policy(monkeypatch):
    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")
    (app,) = load_serve_config(CONFIGS / "cluster.yaml")["applications"]
    assert AppConfig.model_validate(app["args"]).router.policy == "composed"


def test_the_clusters_workers_plan_template_edits_from_block_costs(monkeypatch):
    """The loading DP runs on the cluster's workers: its SD3 edits (block outputs recorded) are planned
    from the profile's block costs, which at half the tokens compute a block in full."""
    from stepserve.engine.editing.masked_sd3 import CacheKind

    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")
    (app,) = load_serve_config(CONFIGS / "cluster.yaml")["applications"]
    config = AppConfig.model_validate(app["args"])
    assert config.edit_cache.enabled and config.edit_cache.cache is CacheKind.OUTPUTS
    planner = config.edit_cache.planner(config.router.profiles)
    use_cache, planned = planner.use_cache(CacheKind.OUTPUTS, 24, "stable-diffusion-3.5-medium", 1024, 1024, 2, 0.5)
    assert planned and 0 < use_cache.count(False) < 24
    assert planner.use_cache(CacheKind.OUTPUTS, 24, "stable-diffusion-3.5-medium", 1024, 1024, 2, 0.1) == ((True,) * 24,
                                                                                                         True)


def test_the_cluster_pool_scales_and_its_bounds_reach_the_router(monkeypatch):
    monkeypatch.setenv("STEPSERVE_API_KEYS", "sk-test")
    (app,) = load_serve_config(CONFIGS / "cluster.yaml")["applications"]
    pool = AppConfig(**app["args"]).pool_spec()
    assert (pool.num_workers, pool.scaling.min_workers, pool.scaling.max_workers) == (14, 6, 22)
    assert pool.bundle == {"CPU": 4, "GPU": 0.75}


@pytest.mark.parametrize("workers, problem", [
    ({"num_workers": 5, "autoscaling": {"min_workers": 1, "max_workers": 4}}, "min_workers <= num_workers"),
    ({"num_workers": 1, "autoscaling": {"min_workers": 2, "max_workers": 4}}, "min_workers <= num_workers"),
    ({"num_workers": 1, "autoscaling": {"min_workers": 1, "max_workers": 4, "target_requests": 0}}, "greater than 0"),
])
def test_bad_pool_bounds_are_refused_at_load(workers, problem):
    (app,) = load_serve_config(CONFIGS / "local-tiny.yaml")["applications"]
    with pytest.raises(ValueError, match=problem):
        AppConfig(**{**app["args"], "workers": workers})
