"""The argument types the sub-commands share."""

import argparse

import pytest

from eldr.commands._args import positive_floats


def test_comma_separated_positive_numbers():
    assert positive_floats("20,60.5, 100") == (20.0, 60.5, 100.0)
    assert positive_floats("7,") == (7.0,)  # a trailing comma is no value


@pytest.mark.parametrize("text,says", [
    ("", "positive numbers"), ("20,x", "comma-separated numbers"), ("0", "positive numbers"),
    ("-5", "positive numbers"), ("nan", "positive numbers"), ("20,inf", "positive numbers"),
])
def test_bad_lists_are_usage_errors_naming_the_text(text, says):
    with pytest.raises(argparse.ArgumentTypeError, match=says) as err:
        positive_floats(text)
    assert repr(text) in str(err.value)


@pytest.mark.parametrize("argv", [["simulate", "--qps", "nan"],
                                  ["reproduce", "--rates", "20,nan"]])
def test_both_commands_refuse_a_nan_rate_with_exit_2(argv, capsys):
    from eldr.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "expected positive numbers" in capsys.readouterr().err
