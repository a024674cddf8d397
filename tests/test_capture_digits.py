import json

import numpy as np
import pytest

from eldr.capture.digits import BASE, INVALID, decode_digits, encode_digits, width_for


def test_alphabet_is_json_safe_and_91_characters():
    text = encode_digits(np.arange(BASE), 1)
    assert len(set(text)) == BASE and '"' not in text and "\\" not in text
    assert json.dumps(text) == f'"{text}"'  # nothing escaped


@pytest.mark.parametrize("width", [1, 2, 3])
def test_round_trip_at_the_edges_of_each_width(width):
    top = BASE**width - 1
    values = np.array([0, 1, BASE - 1, top // 2, top])
    text = encode_digits(values, width)
    assert len(text) == width * values.size
    np.testing.assert_array_equal(decode_digits(text, width), values)


def test_width_for():
    assert [width_for(v) for v in (0, 90, 91, 8280, 8281, 753570)] == [1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="digits"):
        width_for(753571)


def test_foreign_characters_decode_to_invalid():
    for width in (1, 2, 3):
        text = encode_digits(np.array([5, 7]), width)
        bad = "!" + text[1:]  # '!' (33) is not a digit
        assert decode_digits(bad, width)[0] == INVALID
        assert decode_digits(bad, width)[1] == 7


def test_decode_refuses_bad_lengths_and_widths():
    with pytest.raises(ValueError, match="multiple"):
        decode_digits("###", 2)
    with pytest.raises(ValueError, match="width"):
        decode_digits("##", 4)
    with pytest.raises(ValueError, match="ASCII"):
        decode_digits("é", 1)
