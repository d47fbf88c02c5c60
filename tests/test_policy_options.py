"""``--policy-options`` for options that are off by default (declared ``float | None``)."""

from __future__ import annotations

import pytest

from events.tools.cli_args import ArgError
from router_sim.run_args import check_policy_options


@pytest.mark.parametrize("policy", ["kv_overlap", "predicted_ttft"])
@pytest.mark.parametrize("value", [0.1, 1, None])
def test_balance_can_be_turned_on_or_left_off(policy: str, value: float | None) -> None:
    check_policy_options(policy, {"balance": value})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.1", "wants a finite float"),
        (True, "wants a finite float"),
        (float("nan"), "wants a finite float"),
        (float("inf"), "wants a finite float"),
        (-1.0, "balance (epsilon) must be > 0"),
        (0, "balance (epsilon) must be > 0"),
    ],
)
def test_a_bad_balance_is_refused_before_the_run(value: object, message: str) -> None:
    with pytest.raises(ArgError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_policy_options("kv_overlap", {"balance": value})


def test_an_object_option_stays_off_the_command_line() -> None:
    # predicted_ttft's timing model is an object: JSON cannot name one
    with pytest.raises(ArgError, match="cannot be set from the command line"):
        check_policy_options("predicted_ttft", {"timing": 1.0})
