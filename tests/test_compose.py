"""``docker-compose.yml``, checked without a Docker engine: valid under the compose specification's JSON schema
(check-jsonschema's vendored copy), and true to the product -- every agent the default workflows name runs,
every command is one the CLI accepts, every ``STEPSTREAM_*`` variable is a setting some service reads.

Before, the file lacked the compensation agents and the API: under compose every compensation of the default
workflow would have waited for an agent that never ran, and nothing here could tell.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]
from pydantic_settings import BaseSettings

from agents.settings import AgentSettings
from eventstore.settings import ConsumerSettings, KafkaSecuritySettings, KafkaSettings, ObservabilitySettings
from projections.settings import StoreSettings
from scheduler.settings import SchedulerSettings
from schemas.sealed import EncryptionSettings
from stepstream.cli import build_parser
from stepstream.client.outbox import OutboxSettings
from stepstream.http.settings import ApiSettings
from stepstream.local.restarts import RestartSettings
from supervisor.settings import SupervisorSettings

ROOT = Path(__file__).parent.parent
COMPOSE = ROOT / "docker-compose.yml"
SETTINGS: tuple[type[BaseSettings], ...] = (
    AgentSettings, ConsumerSettings, KafkaSecuritySettings, KafkaSettings, ObservabilitySettings, ApiSettings,
    StoreSettings, SchedulerSettings, EncryptionSettings, OutboxSettings, RestartSettings, SupervisorSettings)


def services() -> dict[str, dict[str, Any]]:
    loaded: dict[str, dict[str, Any]] = yaml.safe_load(COMPOSE.read_text())["services"]
    return loaded


def check_compose_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True, timeout=60, check=False)


def test_the_compose_file_is_valid_under_the_compose_specification() -> None:
    checked = check_compose_schema(COMPOSE)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_schema_check_refuses_a_compose_file_with_a_mistake(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period: 40s", "stop_grace_period: [40s]"))
    checked = check_compose_schema(broken)
    assert checked.returncode == 1 and "stop_grace_period" in checked.stdout, checked.stdout


def test_every_agent_the_default_workflows_name_runs_with_a_second_instance() -> None:
    agents = {tuple(s["command"])[2]: s for s in services().values() if s.get("command", [])[:2] == ["run", "agent"]}
    assert set(agents) == SchedulerSettings().load_registry().agents, "forward and compensation agents alike"
    assert all(service["deploy"]["replicas"] >= 2 for service in agents.values())


def test_every_stepstream_command_in_the_file_is_one_the_cli_accepts() -> None:
    parser = build_parser()
    commands = [s["command"] for s in services().values() if s.get("build") and "command" in s]
    assert {c[0] for c in commands} >= {"run", "serve", "topics"}
    for command in commands:
        parser.parse_args(command)  # exits (SystemExit) naming the argument on a command it refuses


def test_every_stepstream_variable_in_the_file_is_a_setting_a_service_reads() -> None:
    known = {f"{settings.model_config.get('env_prefix', '')}{name}".upper()
             for settings in SETTINGS for name in settings.model_fields}
    used = {name for service in services().values() for name in service.get("environment", {})
            if name.startswith("STEPSTREAM_")}
    assert used and not used - known, f"unknown settings: {sorted(used - known)}"


@pytest.mark.parametrize("name", ["projector", "api", "supervisor"])
def test_the_services_that_read_the_state_store_share_one_postgresql_store(name: str) -> None:
    environment = services()[name]["environment"]
    assert environment["STEPSTREAM_STORE_URL"].startswith("postgresql://")
    assert "postgres" in services()[name]["depends_on"]
