"""Every default that an ``eldr ... --help`` text states is the one the code uses.

A help text that says "(default 0.5)" next to ``default=0.25`` misleads silently, and so
does one that names a literal for an option whose real default lives in a plan or a
policy. Each literal default in the help is checked against the parser's own default;
where the parser's default is None (the value comes from elsewhere), against the code
that supplies it (``RESOLVED``); a literal with neither fails this test.
"""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from eldr import cli

# the phrase after "default" or "default:", up to ")" or ";"
DEFAULT = re.compile(r"\bdefault:?\s+([^;)]+)")
NUMBER = re.compile(r"^-?\d+(\.\d+)?$")
# a literal: one word ("0.5", "task", "./eldr-report") or numbers ("15 16 17 18",
# "20,40,60"), alone or before ": why"
LITERAL = re.compile(r"^([\w./-]+|-?\d[\d.]*(?:[ ,]+-?\d[\d.]*)+)(?::\s.*)?$")


def _options():
    """(command, option, action) of every option of every sub-command."""
    def walk(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, (*prefix, name))
            elif action.option_strings and action.help:
                yield " ".join(prefix), action.option_strings[0], action
    return list(walk(cli.build_parser(), ()))


def _stated(action) -> str | None:
    """The literal the help states as the default, or None (none stated, or in words:
    "the artifact's", "8, 4 or 2, the most that ...")."""
    help_text = action.help % {"default": action.default} if "%(" in action.help \
        else action.help
    m = DEFAULT.search(help_text.replace("%%", "%"))
    if m is None:
        return None
    phrase = m.group(1).strip()
    lit = LITERAL.match(phrase)
    if lit is None:
        return None
    word = lit.group(1)
    return word[2:] if word.startswith("./") else word


def _plan(field: str):
    from eldr.reproduce.plan import PLANS

    return getattr(PLANS["default"], field)


def _predictor(param: str):
    from eldr.fit.prompt import PromptPredictor

    return inspect.signature(PromptPredictor.__init__).parameters[param].default


def _cost(param: str):
    from eldr.routing.cost import CostPolicy

    return inspect.signature(CostPolicy.__init__).parameters[param].default


# options whose parser default is None: where the real default comes from
RESOLVED = {
    ("reproduce", "--seed"): lambda: _plan("seed"),
    ("reproduce", "--max-seeds"): lambda: _plan("grid_max_seeds"),
    ("reproduce", "--target-half-width"): lambda: _plan("target_half_width"),
    ("reproduce", "--main-seeds"): lambda: _plan("main_seeds"),
    ("serve", "--load-slack"): lambda: _cost("saturated_slack"),
    ("fit", "--prompt-bits"): lambda: _predictor("bits"),
    ("fit", "--prompt-ranks"): lambda: _predictor("ranks"),
    ("simulate", "--qps"): lambda: _simulate("DEFAULT_QPS"),
    ("simulate", "--workload"): lambda: _simulate("DEFAULT_WORKLOAD"),
}
# options whose stated default is a word that names a rule, not a value
DESCRIBED = {
    ("fit", "--prompt-weightings"),  # "all": every weighting the predictor knows
    ("calibrate", "--name"),  # "calibrated-MODEL": a pattern, MODEL replaced
}


def _simulate(name: str):
    from eldr.commands import simulate

    return getattr(simulate, name)


def _same(stated: str, value) -> bool:
    if isinstance(value, bool):
        return stated.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        return NUMBER.match(stated) is not None and float(stated) == float(value)
    if isinstance(value, (list, tuple)):
        parts = re.split(r"[ ,]+", stated)
        return len(parts) == len(value) and all(
            _same(a, v) for a, v in zip(parts, value, strict=True))
    return stated == str(value)


OPTIONS = _options()


def test_the_parser_has_the_commands_and_options_we_check():
    names = {(c, o) for c, o, _ in OPTIONS}
    assert set(RESOLVED) | DESCRIBED <= names
    assert len(OPTIONS) > 100


@pytest.mark.parametrize("command,option,action",
                         [o for o in OPTIONS if _stated(o[2]) is not None],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_stated_default_is_the_codes(command, option, action):
    stated = _stated(action)
    if (command, option) in DESCRIBED:
        return
    if (command, option) in RESOLVED:
        value = RESOLVED[(command, option)]()
    elif action.default is not None and not isinstance(action.default, bool):
        value = action.default
    elif action.default is None:
        pytest.fail(f"eldr {command} {option}: help says default {stated!r} but the parser's "
                    f"default is {action.default!r}: add where it comes from to RESOLVED")
    else:
        return  # words ("the artifact's", "all pairs"), or a flag: nothing to compare
    assert _same(stated, value), (f"eldr {command} {option}: help says default {stated!r}, "
                                  f"the code uses {value!r}")


@pytest.mark.parametrize("command,option", sorted(RESOLVED))
def test_a_default_from_elsewhere_is_the_one_the_help_states(command, option):
    """Also where the help states it in words ("S = 0 near expert saturation")."""
    action = next(a for c, o, a in OPTIONS if (c, o) == (command, option))
    m = DEFAULT.search(action.help.replace("%%", "%"))
    assert m is not None, f"eldr {command} {option}: the help states no default"
    numbers = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", m.group(1))]
    value = RESOLVED[(command, option)]()
    wanted = value if isinstance(value, (list, tuple)) else [value]
    if all(isinstance(v, (int, float)) for v in wanted):
        assert all(float(v) in numbers for v in wanted), (
            f"eldr {command} {option}: help says {m.group(1)!r}, the code uses {value!r}")
    else:
        assert str(value) in m.group(1)
