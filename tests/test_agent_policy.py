"""The central fault policy: layering, validation that names the field, and reloading a changed file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agents.policy import DependencyPolicy, FilePolicy, PolicyError, StaticPolicy, parse_policy
from agents.retry import RetryPolicy
from agents.settings import AgentSettings
from tests.fakes import FakeClock


def write(path: Path, text: str) -> None:
    """Replace the file atomically, as an operator's deploy tool would (no half-written file is ever read)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


TOML = """
[defaults.retry]
max_retries = 2
initial_backoff_s = 0.2

[defaults.breaker]
failure_threshold = 7

[dependencies.orders.retry]
max_retries = 5
strategy = "incremental"

[dependencies.orders.budget]
retries_per_window = 30
"""


def test_nothing_configured_means_sane_defaults() -> None:
    policy = StaticPolicy().current().for_dependency("anything")
    assert policy.retry.strategy == "exponential" and policy.retry.jitter > 0
    assert policy.retry.max_retries == 3 and policy.retry.call_timeout_s == 10.0
    assert policy.breaker.enabled and policy.budget.enabled


def test_a_dependency_overrides_single_fields_and_inherits_the_rest_from_defaults_and_base() -> None:
    base = DependencyPolicy(retry=RetryPolicy(call_timeout_s=1.5, max_backoff_s=0.3, initial_backoff_s=0.05))
    policy = parse_policy({"defaults": {"retry": {"max_retries": 2, "initial_backoff_s": 0.2}},
                           "dependencies": {"orders": {"retry": {"max_retries": 5}}}}, base)
    orders = policy.for_dependency("orders")
    assert orders.retry.max_retries == 5, "the dependency's own value"
    assert orders.retry.initial_backoff_s == 0.2, "from the file's defaults"
    assert orders.retry.call_timeout_s == 1.5, "from the base (environment)"
    assert policy.for_dependency("other").retry.max_retries == 2


def test_toml_and_json_files_mean_the_same_policy(tmp_path: Path) -> None:
    toml_path = tmp_path / "policy.toml"
    write(toml_path, TOML)
    as_dict: dict[str, Any] = {
        "defaults": {"retry": {"max_retries": 2, "initial_backoff_s": 0.2}, "breaker": {"failure_threshold": 7}},
        "dependencies": {"orders": {"retry": {"max_retries": 5, "strategy": "incremental"},
                                    "budget": {"retries_per_window": 30}}},
    }
    json_path = tmp_path / "policy.json"
    write(json_path, json.dumps(as_dict))
    from_toml, from_json = FilePolicy(toml_path).current(), FilePolicy(json_path).current()
    assert from_toml == from_json
    orders = from_toml.for_dependency("orders")
    assert (orders.retry.strategy, orders.budget.retries_per_window, orders.breaker.failure_threshold) == (
        "incremental", 30, 7)


@pytest.mark.parametrize(("document", "named"), [
    ({"dependencies": {"orders": {"retry": {"max_retries": -1}}}}, "dependencies.orders.retry.max_retries"),
    ({"defaults": {"breaker": {"open_for_s": 0}}}, "defaults.breaker.open_for_s"),
    ({"dependencies": {"orders": {"retry": {"max_retrys": 3}}}}, "dependencies.orders.retry.max_retrys"),
    ({"dependencies": {"orders": {"retry": {"strategy": "fibonacci"}}}}, "dependencies.orders.retry.strategy"),
    ({"dependencies": {"orders": {"retry": {"initial_backoff_s": 9, "max_backoff_s": 1}}}},
     "dependencies.orders.retry"),
    ({"defualts": {}}, "defualts"),
])
def test_a_bad_document_is_refused_with_a_message_naming_the_field(document: dict[str, Any], named: str) -> None:
    with pytest.raises(PolicyError, match=named.replace(".", r"\.")):
        parse_policy(document)


def test_a_bad_or_missing_file_at_start_stops_the_agent_loudly(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="cannot read"):
        FilePolicy(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    write(bad, "[defaults.retry\nmax_retries = 2")
    with pytest.raises(PolicyError, match="not valid TOML"):
        FilePolicy(bad)


def test_a_changed_file_is_applied_at_the_next_check_after_the_poll_interval(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    write(path, "[defaults.retry]\nmax_retries = 1\n")
    clock = FakeClock()
    provider = FilePolicy(path, poll_interval_s=5, clock=clock)
    write(path, "[defaults.retry]\nmax_retries = 4\n")
    clock.now = 4.9
    assert provider.current().defaults.retry.max_retries == 1, "not re-read before the poll interval"
    clock.now = 5.0
    assert provider.current().defaults.retry.max_retries == 4


def test_a_bad_file_at_run_time_is_refused_the_previous_policy_stays_and_a_fix_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    write(path, "[dependencies.orders.retry]\nmax_retries = 1\n")
    clock = FakeClock()
    provider = FilePolicy(path, poll_interval_s=1, clock=clock)
    write(path, "[dependencies.orders.retry]\nmax_retries = -5\n")
    clock.now = 1
    with capture_logs() as logs:
        assert provider.current().for_dependency("orders").retry.max_retries == 1
    refused = [e for e in logs if e["event"].startswith("policy refused")]
    assert refused and refused[0]["log_level"] == "error"
    assert "dependencies.orders.retry.max_retries" in refused[0]["error"]
    clock.now = 2
    with capture_logs() as logs:
        provider.current()
    assert not logs, "the same bad file is reported once, not at every poll"
    write(path, "[dependencies.orders.retry]\nmax_retries = 3\n")
    clock.now = 3
    assert provider.current().for_dependency("orders").retry.max_retries == 3


def test_a_deleted_file_keeps_the_policy_in_force(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    write(path, json.dumps({"defaults": {"retry": {"max_retries": 7}}}))
    clock = FakeClock()
    provider = FilePolicy(path, poll_interval_s=1, clock=clock)
    path.unlink()
    clock.now = 1
    assert provider.current().defaults.retry.max_retries == 7


def test_settings_without_a_file_give_the_environment_policy_and_with_one_layer_the_file_over_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STEPSTREAM_AGENT_CALL_TIMEOUT_S", "1.5")
    monkeypatch.delenv("STEPSTREAM_AGENT_POLICY_FILE", raising=False)
    assert AgentSettings().policy_provider().current().defaults.retry.call_timeout_s == 1.5
    path = tmp_path / "policy.toml"
    write(path, "[dependencies.orders.retry]\nmax_retries = 9\n")
    monkeypatch.setenv("STEPSTREAM_AGENT_POLICY_FILE", str(path))
    orders = AgentSettings().policy_provider().current().for_dependency("orders")
    assert (orders.retry.max_retries, orders.retry.call_timeout_s) == (9, 1.5)
