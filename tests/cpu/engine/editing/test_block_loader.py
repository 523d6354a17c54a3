"""`BlockLoader` on the tiny SD3 transformer: pipelined and naive loading hand out the same
tensors and the same forward; only blocks that use their cache are fetched, in block order;
naive fetches every one before the first block computes, pipelined (on CPU) each when its block
is reached, threaded (a record read from disk) ahead on a thread, the forward waiting for each
block's read alone; CPU use never touches CUDA. (tests/gpu/test_cuda_edits.py checks the side stream's
copies on CUDA against the host tensors, pinned or not.)"""

import threading

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import save_file

from stepserve.engine.editing.block_loader import BlockLoader, pin
from stepserve.engine.editing.masked_sd3 import MaskedPlan, SD3Inputs, masked_forward, recording_forward, token_index
from stepserve.engine.editing.record_file import RecordFile
from stepserve.engine.families.sd3 import TINY

LATENT = 16  # 8 x 8 tokens of patch 2
USE = (True, False, True, True)


@pytest.fixture(scope="module")
def transformer():
    torch.manual_seed(0)
    return SD3Transformer2DModel(**{**TINY["transformer"], "num_layers": len(USE)}).eval()


def _inputs(transformer, device="cpu") -> SD3Inputs:
    g = torch.Generator().manual_seed(0)
    cfg = transformer.config
    inputs = (torch.randn(2, cfg.in_channels, LATENT, LATENT, generator=g),
              torch.randn(2, 5, cfg.joint_attention_dim, generator=g),
              torch.randn(2, cfg.pooled_projection_dim, generator=g), torch.tensor([700.0, 700.0]))
    return SD3Inputs(*(t.to(device) for t in inputs))


def _index(device="cpu") -> torch.Tensor:
    mask = torch.zeros(2, 1, LATENT, LATENT)
    mask[:, :, 4:10, 2:8] = 1
    return token_index(mask, 2).to(device)


class Spy:
    """A host callable that logs each fetch into a shared event log."""

    def __init__(self, blocks, log):
        self.blocks, self.log = blocks, log

    def __call__(self, b):
        self.log.append(("load", b))
        return self.blocks[b]


def _computes(transformer, log):
    """Log each block's computation as it starts (`norm1` runs first in the full and the masked path)."""
    return [block.norm1.register_forward_pre_hook(lambda _, __, b=b: log.append(("compute", b)))
            for b, block in enumerate(transformer.transformer_blocks)]


@pytest.mark.parametrize("naive", [False, True])
def test_a_loader_hands_out_the_host_tensors_of_used_blocks(naive):
    blocks = [torch.randn(2, 4, 3) for _ in USE]
    for host in (blocks, lambda b: blocks[b]):
        loader = BlockLoader(host, USE, "cpu", naive=naive)
        for b, use in enumerate(USE):
            if use:
                assert loader(b) is blocks[b]  # on CPU: no copy
            else:
                with pytest.raises(ValueError, match="does not use its cache"):
                    loader(b)
    assert torch.cuda.is_available() or not torch.cuda.is_initialized()  # (elsewhere other tests use CUDA)


def test_row_groups_are_concatenated_along_rows():
    parts = [[torch.randn(2, 4, 3), torch.randn(1, 4, 3)] for _ in USE]
    loader = BlockLoader(lambda b: parts[b], USE, "cpu")
    assert torch.equal(loader(2), torch.cat(parts[2]))


def test_naive_fetches_every_used_block_in_order_before_the_first_block_computes(transformer):
    inputs = _inputs(transformer)
    _, cache = recording_forward(transformer, inputs)
    log = []
    loader = BlockLoader(Spy(cache, log), USE, "cpu", naive=True)
    assert log == [("load", 0), ("load", 2), ("load", 3)]  # only used blocks, at construction
    hooks = _computes(transformer, log)
    try:
        masked_forward(transformer, inputs, MaskedPlan(_index(), loader, USE))
    finally:
        for hook in hooks:
            hook.remove()
    assert log[3:] == [("compute", b) for b in range(len(USE))]
    with pytest.raises(ValueError, match="handed out already"):
        loader(0)


def test_pipelined_fetches_each_used_block_when_it_is_reached(transformer):
    inputs = _inputs(transformer)
    _, cache = recording_forward(transformer, inputs)
    log = []
    loader = BlockLoader(Spy(cache, log), USE, "cpu")
    assert log == []
    hooks = _computes(transformer, log)
    try:
        masked_forward(transformer, inputs, MaskedPlan(_index(), loader, USE))
    finally:
        for hook in hooks:
            hook.remove()
    assert log == [("load", 0), ("compute", 0), ("compute", 1), ("load", 2), ("compute", 2), ("load", 3),
                   ("compute", 3)]


def test_every_mode_gives_the_forward_with_the_cache_in_a_list(transformer):
    inputs = _inputs(transformer)
    _, cache = recording_forward(transformer, inputs)
    expected = masked_forward(transformer, inputs, MaskedPlan(_index(), cache, USE))
    for naive in (False, True):
        out = masked_forward(transformer, inputs, MaskedPlan(_index(), BlockLoader(cache, USE, "cpu", naive), USE))
        assert torch.equal(out, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins for real where CUDA is")
def test_pin_without_cuda_keeps_the_tensors():
    tensors = {"0.0": torch.randn(2, 3)}
    assert pin(tensors)["0.0"] is tensors["0.0"]
    assert not torch.cuda.is_initialized()


def test_threaded_reads_block_b_while_earlier_blocks_compute(transformer):
    """The reader thread must be able to run ahead: block 2's read is held until block 1 has
    started computing, which a loader that read everything first would deadlock on."""
    inputs = _inputs(transformer)
    _, cache = recording_forward(transformer, inputs)
    expected = masked_forward(transformer, inputs, MaskedPlan(_index(), cache, USE))
    log, computing_1 = [], threading.Event()

    def host(b):
        if b == 2:
            assert computing_1.wait(timeout=30), "block 1 never computed while block 2 was being read"
        log.append(("load", b))
        return cache[b]

    hooks = _computes(transformer, log)
    hooks.append(transformer.transformer_blocks[1].norm1.register_forward_pre_hook(lambda *_: computing_1.set()))
    try:
        out = masked_forward(transformer, inputs, MaskedPlan(_index(), BlockLoader(host, USE, "cpu", threaded=True),
                                                             USE))
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out, expected)
    assert [e for e in log if e[0] == "load"] == [("load", 0), ("load", 2), ("load", 3)]
    assert log.index(("load", 2)) > log.index(("compute", 1)) and log.index(("load", 2)) < log.index(("compute", 2))


def test_threaded_reads_a_spilled_record_and_hands_on_a_failed_read(transformer, tmp_path):
    inputs = _inputs(transformer)
    _, cache = recording_forward(transformer, inputs)
    expected = masked_forward(transformer, inputs, MaskedPlan(_index(), cache, USE))
    save_file({str(b): t for b, t in enumerate(cache)}, tmp_path / "record.safetensors")
    with RecordFile(tmp_path / "record.safetensors") as record:
        loader = BlockLoader(lambda b: record.read(str(b), cold=True), USE, "cpu", threaded=True)
        assert torch.equal(masked_forward(transformer, inputs, MaskedPlan(_index(), loader, USE)), expected)

    def broken(b):
        if b == 2:
            raise OSError("disk gone")
        return cache[b]

    loader = BlockLoader(broken, USE, "cpu", threaded=True)
    assert loader(0) is cache[0]
    with pytest.raises(RuntimeError, match="reading block 2") as failure:
        loader(2)
    assert isinstance(failure.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="reading block 3"):
        loader(3)


def test_threaded_is_for_cpu_only():
    with pytest.raises(ValueError, match="threaded loading is for a CPU computation"):
        BlockLoader([torch.zeros(1)], (True,), "meta", threaded=True)
