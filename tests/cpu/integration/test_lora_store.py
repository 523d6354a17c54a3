"""The LoRA store as a Ray actor: reads a LoRA once however many ask, hands it out through the
object store, keeps the most recently used within its bytes, and fails only the fetches of a
LoRA it cannot read."""

import pytest
import ray

from stepserve.actors.lora_store import LoraStore
from stepserve.engine.addons.lora import from_arrays
from stepserve.engine.addons.presets import preset_lora, save_lora_file
from stepserve.engine.addons.source import AddonKind, AddonSource
from stepserve.engine.families import DENOISER, load_family

from tests.tiny import TINY


def source(name, **where):
    return AddonSource(AddonKind.LORA, name, TINY.name, **where)


@pytest.fixture(scope="module")
def tiny_lora_bytes():
    return preset_lora("x", load_family(TINY, {DENOISER}).denoiser, 1).nbytes


def test_fetch_reads_once_and_hands_out_the_weights(live_app, tiny_lora_bytes):
    store = ray.remote(LoraStore).options(num_cpus=0).remote(
        [source("a", preset="tiny", seed=11), source("b", preset="tiny", seed=12)], [TINY], 10 * tiny_lora_bytes)
    refs = ray.get([store.fetch.remote(TINY.name, "a") for _ in range(4)])
    assert ray.get(store.__ray_call__.remote(lambda self: self.loads)) == 1
    lora = from_arrays(ray.get(refs[0][0]))
    expected = preset_lora("a", load_family(TINY, {DENOISER}).denoiser, 11)
    assert lora.layers.keys() == expected.layers.keys()
    assert all((lora.layers[m].up == expected.layers[m].up).all() for m in lora.layers)
    with pytest.raises(ray.exceptions.RayTaskError, match="not served"):
        ray.get(store.fetch.remote(TINY.name, "nope"))
    ray.kill(store)


def test_the_store_keeps_the_most_recent_within_its_bytes(live_app, tiny_lora_bytes):
    store = ray.remote(LoraStore).options(num_cpus=0).remote(
        [source(n, preset="tiny", seed=i) for i, n in enumerate("abc")], [TINY], int(2.5 * tiny_lora_bytes))
    for name in "abac":
        ray.get(store.fetch.remote(TINY.name, name))
    assert ray.get(store.held.remote()) == [(TINY.name, "a"), (TINY.name, "c")]
    ray.get(store.prefetch.remote(TINY.name, ["b"]))
    assert ray.get(store.held.remote()) == [(TINY.name, "c"), (TINY.name, "b")]
    ray.kill(store)


def test_a_bad_file_fails_its_fetches_and_a_fixed_one_loads(live_app, tmp_path):
    path = tmp_path / "style.safetensors"
    path.write_bytes(b"not a safetensors file")
    store = ray.remote(LoraStore).options(num_cpus=0).remote([source("style", path=str(path))], [TINY], 1 << 30)
    with pytest.raises(ray.exceptions.RayTaskError):
        ray.get(store.fetch.remote(TINY.name, "style"))
    saved = save_lora_file(preset_lora("style", load_family(TINY, {DENOISER}).denoiser, 3), str(tmp_path / "ok"))
    path.write_bytes(open(saved, "rb").read())
    (ref,) = ray.get(store.fetch.remote(TINY.name, "style"))
    assert from_arrays(ray.get(ref)).name == "style"
    ray.kill(store)
