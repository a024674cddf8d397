"""Report roles (eldr.routing.roles): what the reproduction's report needs of a policy,
checked when the policy is registered; the registry's lookups by role and flag."""

from __future__ import annotations

import pytest

from eldr.routing import (
    POLICIES,
    ReportRole,
    register_policy,
    registry,
    report_flagged,
    report_policies,
)


@pytest.fixture
def restore():
    """The registry as it was, whatever a test registered."""
    saved = dict(registry.POLICIES)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def _factory(K, **_):
    raise AssertionError("not built in these tests")


def test_the_registered_policies_roles_give_the_reports_groups():
    assert report_policies() == ("random", "round_robin", "jsq", "p2c", "domain", "eldr",
                                 "eldr_cost", "oracle_signature")  # report order
    assert report_policies("balancer", grid=True) == ("round_robin", "jsq", "p2c")
    assert report_policies("balancer", grid=False) == ("random",)
    assert report_policies("locality", grid=True) == ("eldr", "eldr_cost")
    assert report_policies("oracle") == ("domain", "oracle_signature")
    assert "eldr_top1" not in report_policies()  # registered without a report role
    assert report_flagged("primary") == ("eldr",)
    assert report_flagged("reference") == ("jsq",)
    assert report_flagged("paper_baseline") == ("round_robin",)
    assert report_flagged("check_pair") == ("jsq", "p2c")
    assert report_flagged("before_prefill") == ("eldr_cost",)
    cost = POLICIES["eldr_cost"].report
    assert (cost.key, cost.label, cost.online_key, cost.sweep_weight) == \
        ("cost", "eldr_cost", "online", 2.0)
    assert POLICIES["jsq"].report.key == "jsq"  # key and label default to the name
    assert POLICIES["oracle_signature"].reads_true_decode
    assert not POLICIES["domain"].reads_true_decode
    with pytest.raises(ValueError, match="report flag must be one of"):
        report_flagged("favourite")
    with pytest.raises(ValueError, match="role must be one of"):
        report_policies("baseline")


def test_a_complete_locality_role_is_registered_and_listed(restore):
    register_policy("lean", _factory, needs={"centroids"}, role="locality",
                    report=ReportRole(order=20, key="lean", title="A lean one", grid=True))
    assert report_policies("locality", grid=True) == ("eldr", "eldr_cost", "lean")
    assert report_policies()[-1] == "lean"


@pytest.mark.parametrize("kwargs, field", [
    # a role without what the role needs
    (dict(role="locality", report=ReportRole(order=20)), "report.title"),
    (dict(role="locality", needs={"num_layers"}, options={"tau"},
          report=ReportRole(order=20, primary=True)), "report.primary"),
    (dict(role="locality", needs={"num_layers"},
          report=ReportRole(order=20, title="t", online_key="x")), "report.online_key"),
    (dict(report=ReportRole(order=20, check_pair=True)), "report.check_pair"),  # no grid
    # a flag of another role
    (dict(report=ReportRole(order=20, primary=True)), "report.primary"),
    (dict(role="locality", report=ReportRole(order=20, title="t", reference=True)),
     "report.reference"),
    (dict(role="oracle", report=ReportRole(order=20, grid=True)), "report.grid"),
    (dict(report=ReportRole(order=20, preference=3)), "report.preference"),
    # contradicting a registered policy's role
    (dict(report=ReportRole(order=2)), "report.order"),  # jsq's
    (dict(report=ReportRole(order=20, key="cost")), "report.key"),  # eldr_cost's
    (dict(role="locality", options={"decoder_profiles"},
          report=ReportRole(order=20, title="t", online_key="online")), "report.key"),
    (dict(report=ReportRole(order=20, reference=True)), "report.reference"),  # jsq is
    (dict(report=ReportRole(order=20, grid=True, check_pair=True)), "report.check_pair"),
    (dict(role="locality", report=ReportRole(order=20, title="t", preference=0)),
     "report.preference"),
    # malformed values
    (dict(report=ReportRole(order=1.5)), "report.order"),
    (dict(report=ReportRole(order=20, key="")), "report.key"),
    (dict(report=ReportRole(order=20, sweep_weight=0.0)), "report.sweep_weight"),
    (dict(report={"order": 20}), "report must be a ReportRole"),
    # the registration itself
    (dict(needs={"centroids"}, options={"centroids"}), "options"),
    (dict(factory="not callable"), "factory"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_an_incomplete_or_contradictory_registration_is_refused_naming_the_field(
        restore, kwargs, field):
    before = dict(POLICIES)
    factory = kwargs.pop("factory", _factory)
    with pytest.raises(ValueError) as err:
        register_policy("new-policy", factory, **kwargs)
    message = str(err.value)
    assert field in message and "\n" not in message  # one line naming the field
    assert "'new-policy'" in message
    assert dict(POLICIES) == before  # nothing registered


def test_a_duplicate_name_is_refused_naming_the_name(restore):
    with pytest.raises(ValueError, match=r"^policy 'jsq': name is already registered$"):
        register_policy("jsq", _factory, report=ReportRole(order=20))


def test_a_missing_flag_holder_is_named_by_the_lookup(restore):
    registry._REGISTRY.pop("p2c")  # the check pair now has one balancer
    with pytest.raises(ValueError, match=r"needs 2 registered policies with "
                                         r"report.check_pair, found 1"):
        report_flagged("check_pair")
