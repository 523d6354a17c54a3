"""bench_engine_overhead's device handling (the engine-level timing itself runs in benchmarks)."""

import argparse

import pytest

from stepserve.load_tests.bench_engine_overhead import device_arg, parse_args, same_image_tolerance


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:1"])
def test_device_arg_accepts_cpu_and_cuda(text):
    assert device_arg(text) == text


@pytest.mark.parametrize("text", ["gpu", "cuda:x", "cpu:0", "mps"])
def test_device_arg_rejects_others(text):
    with pytest.raises(argparse.ArgumentTypeError):
        device_arg(text)


def test_live_level_is_refused_on_cuda(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--device", "cuda", "--live"])
    assert "--device cpu" in capsys.readouterr().err
    assert parse_args(["--out", "x", "--live"]).device == "cpu"


def test_same_image_tolerance_is_tight_only_for_cpu_float32():
    assert same_image_tolerance("cpu", "float32") == 1e-3
    assert same_image_tolerance("cuda", "float32") > 1e-3
    assert same_image_tolerance("cuda", "float16") > same_image_tolerance("cuda", "float32")
