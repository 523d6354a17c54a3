"""`RecordFile` reads the activation cache's spill files (safetensors) one tensor at a time:
the same tensors as safetensors' own loader, warm or cold, for the dtypes records use; a wrong
name, a truncated file and a foreign file are clear errors."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from stepserve.engine.editing.record_file import RecordFile


@pytest.fixture()
def spilled(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"0.0": torch.randn(2, 16, 8, generator=g), "0.1": torch.randn(2, 16, 8, generator=g).half(),
               "1.0": torch.randn(3, 5, generator=g).bfloat16(), "1.1": torch.zeros(0, 4),
               "mask": torch.rand(4, 4, generator=g) > 0.5}
    path = tmp_path / "record.safetensors"
    save_file(tensors, path)
    return path, tensors


@pytest.mark.parametrize("cold", [False, True])
def test_reads_every_tensor_as_safetensors_does(spilled, cold):
    path, tensors = spilled
    reference = load_file(path)
    with RecordFile(path) as record:
        assert set(record.names) == set(tensors)
        for name, tensor in tensors.items():
            read = record.read(name, cold=cold)
            assert read.dtype == tensor.dtype and torch.equal(read, reference[name])
            assert record.nbytes(name) == tensor.nbytes
        record.drop_cached_pages()
        assert torch.equal(record.read("0.0"), tensors["0.0"])


def test_each_read_is_new_memory(spilled):
    path, _ = spilled
    with RecordFile(path) as record:
        first, second = record.read("0.0"), record.read("0.0")
        first.zero_()
        assert second.abs().sum() > 0


def test_unknown_names_and_bad_files_are_clear_errors(spilled, tmp_path):
    path, _ = spilled
    with RecordFile(path) as record, pytest.raises(KeyError, match="no tensor '9.9'"):
        record.read("9.9")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="outside the file"):
        RecordFile(truncated)
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\xff" * 32)
    with pytest.raises(ValueError, match="header of"):
        RecordFile(foreign)


def test_close_releases_the_file(spilled):
    path, _ = spilled
    record = RecordFile(path)
    fd = record._fd
    record.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    record.close()  # twice is fine
