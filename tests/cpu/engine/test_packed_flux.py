"""Mixed-resolution Flux forwards by token concatenation: rows of four sizes (among them 64x128
and 128x64, which pack to the same token count with other position ids) packed into one forward
each equal `FluxTransformer2DModel` run on them alone, with per-row timesteps and guidance, on
the tiny preset and on a deeper, wider layout without a guidance embedding (as schnell); the
family runs a step group's members of any sizes through it in their order."""

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

from stepserve.engine.families import DENOISER, load_family
from stepserve.engine.families.flux import TINY
from stepserve.engine.forward_modes.base import ModeName
from stepserve.engine.packing.packed_flux import FluxInputs, packed_forward
from stepserve.engine.packing.packed_rows import PackedRows

from tests.tiny import TINY_FLUX

TOL = dict(atol=1e-5, rtol=1e-5)
# Unpacked latent sides of 64, 64x128, 128x64 and 96 px at the tiny VAE's 8x: 16, 32, 32 and 36 tokens of 2x2.
SIZES = ((8, 8), (8, 16), (16, 8), (12, 12))
TEXT_TOKENS = 7


@pytest.fixture(scope="module")
def family():
    return load_family(TINY_FLUX, {DENOISER}, "cpu")


@pytest.fixture(scope="module")
def schnell_layout():
    """Two double- and three single-stream blocks of four heads, no guidance embedding."""
    torch.manual_seed(3)
    config = {**TINY["transformer"], "num_layers": 2, "num_single_layers": 3, "num_attention_heads": 4,
              "guidance_embeds": False}
    return FluxTransformer2DModel(**config).eval()


@pytest.fixture(params=["preset", "schnell_layout"])
def transformer(request, family):
    return family.denoiser if request.param == "preset" else request.getfixturevalue(request.param)


def _piece(transformer, size, rows=2, seed=0) -> FluxInputs:
    """Rows at one unpacked latent size, each with its own timestep and guidance, as the family packs them."""
    g = torch.Generator().manual_seed(seed)
    cfg = transformer.config
    h, w = size[0] // 2, size[1] // 2
    return FluxInputs(
        hidden_states=torch.randn(rows, h * w, cfg.in_channels, generator=g),
        img_ids=FluxPipeline._prepare_latent_image_ids(rows, h, w, "cpu", torch.float32),
        encoder_hidden_states=torch.randn(rows, TEXT_TOKENS, cfg.joint_attention_dim, generator=g),
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
        pooled_projections=torch.randn(rows, cfg.pooled_projection_dim, generator=g),
        timestep=torch.rand(rows, generator=g),
        guidance=1.0 + 6.0 * torch.rand(rows, generator=g) if cfg.guidance_embeds else None,
    )


def _alone(transformer, piece: FluxInputs, img_ids=None) -> torch.Tensor:
    with torch.inference_mode():
        return transformer(hidden_states=piece.hidden_states, encoder_hidden_states=piece.encoder_hidden_states,
                           pooled_projections=piece.pooled_projections, timestep=piece.timestep,
                           img_ids=piece.img_ids if img_ids is None else img_ids, txt_ids=piece.txt_ids,
                           guidance=piece.guidance, return_dict=False)[0]


def test_rows_of_four_resolutions_each_equal_their_forward_alone(transformer):
    pieces = [_piece(transformer, size, rows=2 if i % 2 else 1, seed=i) for i, size in enumerate(SIZES)]
    outputs = packed_forward(transformer, pieces)
    for piece, out in zip(pieces, outputs):
        assert out.shape == piece.hidden_states.shape
        torch.testing.assert_close(out, _alone(transformer, piece), **TOL)


def test_tall_and_wide_rows_keep_their_own_position_ids(family):
    """64x128 and 128x64 have as many tokens; the other's ids would give another prediction."""
    wide, tall = _piece(family.denoiser, SIZES[1], seed=1), _piece(family.denoiser, SIZES[2], seed=1)
    out_wide, out_tall = packed_forward(family.denoiser, [wide, tall])
    torch.testing.assert_close(out_wide, _alone(family.denoiser, wide), **TOL)
    assert not torch.allclose(out_wide, _alone(family.denoiser, wide, img_ids=tall.img_ids), atol=1e-3)
    torch.testing.assert_close(out_tall, _alone(family.denoiser, tall), **TOL)


def test_one_piece_equals_the_plain_forward(family):
    piece = _piece(family.denoiser, SIZES[3], rows=3, seed=4)
    (out,) = packed_forward(family.denoiser, [piece])
    torch.testing.assert_close(out, _alone(family.denoiser, piece), **TOL)


def test_what_the_path_does_not_reproduce_is_refused(family):
    denoiser = family.denoiser
    short = _piece(denoiser, SIZES[0])
    other = FluxInputs(**{**vars(short), "encoder_hidden_states": short.encoder_hidden_states[:, :3],
                          "txt_ids": short.txt_ids[:3]})
    with pytest.raises(ValueError, match="same text length"):
        packed_forward(denoiser, [short, other])
    with pytest.raises(ValueError, match="guidance"):
        packed_forward(denoiser, [FluxInputs(**{**vars(short), "guidance": None})])
    torch.manual_seed(0)
    adapted = FluxTransformer2DModel(**TINY["transformer"]).eval()
    inner = adapted.config.num_attention_heads * adapted.config.attention_head_dim
    adapted.single_transformer_blocks[0].attn.set_processor(FluxIPAdapterAttnProcessor(inner, 8))
    with pytest.raises(ValueError, match="FluxIPAdapterAttnProcessor"):
        packed_forward(adapted, [short])


def test_text_first_join_places_each_rows_text_before_its_image_tokens():
    rows = PackedRows.of([2, 3], text_tokens=2, device=torch.device("cpu"), text_first=True)
    image = torch.tensor([[10.0], [11.0], [20.0], [21.0], [22.0]])
    text = torch.tensor([[[-1.0], [-2.0]], [[-3.0], [-4.0]]])
    joined = rows.join(image, text)
    assert joined.flatten().tolist() == [-1, -2, 10, 11, -3, -4, 20, 21, 22]
    assert rows.joined_lengths == (4, 5)
    back_image, back_text = rows.split(joined)
    assert torch.equal(back_image, image) and torch.equal(back_text, text)
    assert rows.per_joined_token(torch.tensor([[1.0], [2.0]])).flatten().tolist() == [1, 1, 1, 1, 2, 2, 2, 2, 2]


def test_family_runs_members_of_any_sizes_in_their_order(family):
    """Members of one latent shape go in as one piece; each member gets back its own rows."""
    members = []
    for i, size in enumerate([SIZES[1], SIZES[0], SIZES[2], SIZES[1], SIZES[3]]):
        g = torch.Generator().manual_seed(i)
        sample = torch.randn(1, 16, *size, generator=g)
        cond = {"context": torch.randn(1, TEXT_TOKENS, 32, generator=g), "pooled": torch.randn(1, 32, generator=g),
                "guidance": torch.tensor([2.0 + i])}
        members.append((sample, torch.tensor([900.0 - 150.0 * i]), cond))
    outputs = family.denoise_mixed(members)
    assert ModeName.PACKED in family.forward_modes and family.packs([tuple(m[0].shape[1:]) for m in members])
    assert len(outputs) == len(members)
    for (sample, timesteps, cond), out in zip(members, outputs):
        assert out.shape == sample.shape
        torch.testing.assert_close(out, family.denoise(sample, timesteps, cond), **TOL)
