"""Mixed-resolution SD3 forwards by token concatenation on the tiny transformer: rows of three
sizes packed into one forward each equal `SD3Transformer2DModel` run on them alone, under CFG
(two rows a request) and per-row timesteps, on SD3.5's layout (a dual-attention block, q/k RMS
norm) and SD3-medium's (neither); the family runs a step group's members of any sizes through it
in their order."""

import pytest
import torch
from diffusers import SD3Transformer2DModel

from stepserve.engine.editing.masked_sd3 import SD3Inputs
from stepserve.engine.families import DENOISER, FAMILIES, load_family
from stepserve.engine.families.sd3 import TINY
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.packing.packed_rows import PackedRows
from stepserve.engine.packing.packed_sd3 import packed_forward

from tests.tiny import TINY_SD3

TOL = dict(atol=1e-5, rtol=1e-5)
# Latent sizes of 64, 96 and 128 px and a 64 x 128 one at the tiny VAE's 8x: 16, 36, 64 and 32 tokens of patch 2.
SIZES = ((8, 8), (12, 12), (16, 16), (8, 16))
TEXT_TOKENS = 7


@pytest.fixture(scope="module")
def family():
    return load_family(TINY_SD3, {DENOISER}, "cpu")


@pytest.fixture(scope="module")
def sd3_medium_layout():
    """Three blocks without dual attention or q/k norm: one block is neither first nor last."""
    torch.manual_seed(3)
    config = {**TINY["transformer"], "num_layers": 3, "dual_attention_layers": (), "qk_norm": None}
    return SD3Transformer2DModel(**config).eval()


@pytest.fixture(params=["preset", "sd3_medium_layout"])
def transformer(request, family):
    """The tiny preset's transformer: block 0 has dual attention, block 1 is the last
    (`context_pre_only`); or SD3-medium's layout."""
    return family.denoiser if request.param == "preset" else request.getfixturevalue(request.param)


def _piece(transformer, size, rows=2, seed=0) -> SD3Inputs:
    """A request's rows at one latent size: under CFG two rows at one timestep, as a sampler gives them."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    return SD3Inputs(
        hidden_states=torch.randn(rows, cfg.in_channels, *size, generator=g),
        encoder_hidden_states=torch.randn(rows, TEXT_TOKENS, cfg.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(rows, cfg.pooled_projection_dim, generator=g),
        timestep=torch.full((rows,), 100.0 + 250.0 * seed),
    )


def _alone(transformer, piece: SD3Inputs) -> torch.Tensor:
    with torch.inference_mode():
        return transformer(hidden_states=piece.hidden_states, encoder_hidden_states=piece.encoder_hidden_states,
                           pooled_projections=piece.pooled_projections, timestep=piece.timestep,
                           return_dict=False)[0]


def test_rows_of_three_resolutions_each_equal_their_forward_alone(transformer):
    pieces = [_piece(transformer, size, rows=2, seed=i) for i, size in enumerate(SIZES[:3])]
    outputs = packed_forward(transformer, pieces)
    for piece, out in zip(pieces, outputs):
        assert out.shape == piece.hidden_states.shape
        torch.testing.assert_close(out, _alone(transformer, piece), **TOL)


def test_non_square_and_single_rows_mixed_with_cfg_rows(transformer):
    pieces = [_piece(transformer, SIZES[3], rows=1, seed=0), _piece(transformer, SIZES[2], rows=2, seed=1),
              _piece(transformer, SIZES[0], rows=1, seed=2)]
    for piece, out in zip(pieces, packed_forward(transformer, pieces)):
        torch.testing.assert_close(out, _alone(transformer, piece), **TOL)


def test_one_piece_equals_the_plain_forward(family):
    piece = _piece(family.denoiser, SIZES[1], rows=2, seed=4)
    (out,) = packed_forward(family.denoiser, [piece])
    torch.testing.assert_close(out, _alone(family.denoiser, piece), **TOL)


def test_pieces_with_different_text_lengths_are_refused(family):
    short = _piece(family.denoiser, SIZES[0])
    other = SD3Inputs(short.hidden_states, short.encoder_hidden_states[:, :3], short.pooled_projections,
                      short.timestep)
    with pytest.raises(ValueError, match="same text length"):
        packed_forward(family.denoiser, [short, other])


def test_join_and_split_place_each_rows_text_after_its_image_tokens():
    rows = PackedRows.of([2, 3], text_tokens=2, device=torch.device("cpu"))
    image = torch.tensor([[10.0], [11.0], [20.0], [21.0], [22.0]])
    text = torch.tensor([[[-1.0], [-2.0]], [[-3.0], [-4.0]]])
    joined = rows.join(image, text)
    assert joined.flatten().tolist() == [10, 11, -1, -2, 20, 21, 22, -3, -4]
    assert rows.joined_lengths == (4, 5)
    back_image, back_text = rows.split(joined)
    assert torch.equal(back_image, image) and torch.equal(back_text, text)
    assert rows.per_token(torch.tensor([[1.0], [2.0]])).flatten().tolist() == [1, 1, 2, 2, 2]


def test_family_runs_members_of_any_sizes_in_their_order(family):
    """Members of equal size go in as one piece; each member gets back its own rows."""
    members = []
    for i, (size, rows) in enumerate([(SIZES[0], 2), (SIZES[2], 1), (SIZES[0], 1), (SIZES[1], 2)]):
        piece = _piece(family.denoiser, size, rows=rows, seed=i)
        members.append((piece.hidden_states, piece.timestep,
                        {"context": piece.encoder_hidden_states, "pooled": piece.pooled_projections}))
    outputs = family.denoise_mixed(members)
    assert len(outputs) == len(members)
    for (sample, timesteps, cond), out in zip(members, outputs):
        torch.testing.assert_close(out, family.denoise(sample, timesteps, cond), **TOL)


def test_families_declaring_the_packed_mode_have_denoise_mixed():
    mixing = {name for name, cls in FAMILIES.items() if ModeName.PACKED in cls.forward_modes}
    assert {"sd3", "flux"} <= mixing and not mixing & {"wan", "wan-ti2v"}
    assert all(callable(getattr(FAMILIES[name], "denoise_mixed", None)) for name in mixing)
