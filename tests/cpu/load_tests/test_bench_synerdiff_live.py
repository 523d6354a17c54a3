"""The live SynerDiff benchmark's variants are configs the app accepts (the run itself is a
benchmark: it serves the embedded default for minutes)."""

import pytest

from stepserve.deployments.config import AppConfig
from stepserve.load_tests.bench_synerdiff_live import VARIANTS, variant_config
from stepserve.runtime import default_config_path, load_serve_config


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_is_a_valid_app(name):
    chunks, quality, profile, controller = VARIANTS[name]
    config = variant_config(load_serve_config(default_config_path()), 8123, chunks, quality, profile, controller)
    app = AppConfig.model_validate(config["applications"][0]["args"])
    pool = app.pool_spec()
    assert pool.decode_images and pool.decode_chunks == chunks
    assert (pool.sequencer is not None) == (profile is not None)
    assert (pool.sequencer is not None and pool.sequencer.controller is not None) == controller
    assert app.models[0].skip_cfg_quality == quality
