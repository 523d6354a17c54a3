"""Where each row's tokens lie when rows of different lengths are packed along one token axis.

A packed DiT forward holds the image tokens of all rows as one [N, H] tensor, row after row,
and each row's text tokens as a [rows, T, H] batch (every row has the same text length). Joint
attention needs each row's image and text tokens together, in the order diffusers' joint
processors concatenate them: image then text for SD3's, text then image for Flux's
(`text_first`); `join` and `split` move between the two layouts with one indexed copy each.
`per_token` spreads a per-row vector (a row's AdaLN shift, scale or gate) over that row's image
tokens, and `per_joined_token` over its joined tokens (Flux's single-stream blocks run on the
joined sequence), so token-wise layers modulate each token by its own row's conditioning.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """The packing of rows with `lengths` image tokens each (in row order) and `text_tokens` text
    tokens each, joined text first where `text_first`; index tensors on the forward's device."""

    lengths: tuple[int, ...]
    text_tokens: int
    text_first: bool
    row_of_token: torch.Tensor  # [N]: the row of each packed image token
    row_of_joined: torch.Tensor  # [N + rows * T]: the row of each joined token
    image_positions: torch.Tensor  # [N]: each image token's place among the joined tokens
    text_positions: torch.Tensor  # [rows * T]: each text token's place among the joined tokens, row by row

    @classmethod
    def of(cls, lengths: Sequence[int], text_tokens: int, device: torch.device,
           text_first: bool = False) -> "PackedRows":
        if not lengths or min(lengths) < 1 or text_tokens < 0:
            raise ValueError(f"expected one or more rows of one or more image tokens, got {list(lengths)}; "
                             f"text tokens {text_tokens}")
        sizes = torch.tensor(lengths, device=device)
        rows, total = len(lengths), int(sum(lengths))
        row_ids = torch.arange(rows, device=device)
        row_of_token = torch.repeat_interleave(row_ids, sizes, output_size=total)
        row_of_joined = torch.repeat_interleave(row_ids, sizes + text_tokens, output_size=total + rows * text_tokens)
        # Where each row's joint sequence, and its image tokens among the packed ones, start.
        joined_starts = torch.cumsum(sizes + text_tokens, 0) - (sizes + text_tokens)
        image_starts = torch.cumsum(sizes, 0) - sizes
        within = torch.arange(total, device=device) - image_starts[row_of_token]
        image_offset, text_offset = (text_tokens, 0) if text_first else (0, sizes)
        image_positions = joined_starts[row_of_token] + image_offset + within
        text_starts = joined_starts + text_offset
        text_positions = text_starts[:, None] + torch.arange(text_tokens, device=device)[None, :]
        return cls(tuple(int(n) for n in lengths), text_tokens, text_first, row_of_token, row_of_joined,
                   image_positions, text_positions.flatten())

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def joined_lengths(self) -> tuple[int, ...]:
        """Each row's joint sequence: its image and its text tokens."""
        return tuple(n + self.text_tokens for n in self.lengths)

    def per_token(self, per_row: torch.Tensor) -> torch.Tensor:
        """[rows, F] -> [N, F]: each image token gets its row's vector."""
        return per_row.index_select(0, self.row_of_token)

    def per_joined_token(self, per_row: torch.Tensor) -> torch.Tensor:
        """[rows, F] -> [N + rows * T, F]: each joined token gets its row's vector."""
        return per_row.index_select(0, self.row_of_joined)

    def join(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Packed image tokens [N, F] and text tokens [rows, T, F] -> [N + rows * T, F]: each row's
        image and text tokens (text first where `text_first`), row after row."""
        joined = image.new_empty(image.shape[0] + self.rows * self.text_tokens, image.shape[-1])
        joined.index_copy_(0, self.image_positions, image)
        return joined.index_copy_(0, self.text_positions, text.reshape(-1, text.shape[-1]).to(image.dtype))

    def split(self, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`join`'s inverse: (image tokens [N, F], text tokens [rows, T, F])."""
        text = joined.index_select(0, self.text_positions)
        return joined.index_select(0, self.image_positions), text.view(self.rows, self.text_tokens, -1)
