"""The procedural dataset: deterministic by (seed, index), captions in the documented grammar,
and a caption's words are single tokens of the shipped tokenizer."""

import re

import numpy as np

from stepserve.engine.shapes import dataset
from stepserve.engine.shapes.training import caption_words
from stepserve.engine.tokenizer import word_clip_tokenizer

COLOUR = "|".join(dataset.COLOURS)
GRAMMAR = re.compile(
    rf"^(a|an) (?:(small|large) )?({COLOUR}) ({'|'.join(dataset.SHAPES)}) on (a|an) ({COLOUR}) background"
    rf"(?:, ({'|'.join(dataset.POSITIONS)}))?$")


def test_a_sample_is_the_same_picture_and_caption_every_time_and_in_any_order():
    scene, picture, silhouette = dataset.sample(7, 3)
    renders = dataset.Renders(7, 10)
    assert renders.scenes[3] == scene
    assert np.array_equal(renders.pictures([9, 3])[1], picture)
    assert np.array_equal(renders.silhouettes([3])[0], silhouette)
    assert dataset.sample(8, 3)[0] != scene or not np.array_equal(dataset.sample(8, 3)[1], picture)


def test_captions_follow_the_grammar_and_say_what_is_drawn():
    for i in range(300):
        scene, picture, silhouette = dataset.sample(0, i)
        match = GRAMMAR.match(scene.caption)
        assert match, scene.caption
        assert match.group(1) == ("an" if match.group(2 if match.group(2) else 3)[0] in "aeiou" else "a")
        assert match.group(3) == scene.colour != match.group(6) == scene.background
        assert match.group(4) == scene.shape
        # The background colour fills the corners; the silhouette is the shape in white on black.
        assert np.abs(picture[0, 0].astype(int) - dataset.COLOURS[scene.background]).max() <= 2
        covered = (silhouette[..., 0] > 127).mean()
        assert 0.02 < covered < 0.3
    said = [dataset.sample(0, i)[0] for i in range(300)]
    assert {s.say_size for s in said} == {True, False} and {s.say_position for s in said} == {True, False}


def test_the_outlined_style_draws_less_of_the_shape_in_the_same_place():
    _, filled, silhouette = dataset.sample(0, 1)
    _, outlined, _ = dataset.sample(0, 1, style="outlined")
    inside = silhouette[..., 0] > 127
    assert np.abs(filled.astype(int) - outlined.astype(int))[inside].mean() > 20
    assert np.array_equal(filled[~inside][:20], outlined[~inside][:20]) or \
        np.abs(filled.astype(int) - outlined.astype(int))[~inside].mean() < 5


def test_every_caption_word_is_one_token_and_other_words_still_tokenize():
    tokenizer = word_clip_tokenizer(caption_words(), 32)
    for word in caption_words():
        assert len(tokenizer.tokenize(word)) == 1, word
    ids = tokenizer("a red fox in the snow").input_ids
    assert ids[0] == 0 and ids[-1] == 1 and len(ids) > 4
