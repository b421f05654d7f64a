"""Every config key of the agent and the collector is a flag and an environment variable,
generated from the config definition, and ``--help`` shows each with its variable.

The walk sets every key at once to a value other than its default, once through flags and
once through ``FOREWARN_<SERVICE>_<KEY>``, parses it as the real command line does, and
checks both give the same config, in which no key kept its default."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types
import typing
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from forewarn.agent.config import AgentConfig
from forewarn.cli import build_parser
from forewarn.collector.config import CollectorConfig
from forewarn.config import load_from_args

from support.polling import START_TIMEOUT_S, free_port, wait_for

# Values that the generic rule below would not make valid (choices, formats, pairs).
SPECIAL: dict[str, str] = {
    "source": "sim", "listen": "127.0.0.1:9999", "socket_mode": "0600",
    "hang_action": "terminate", "log_level": "debug", "log_format": "json",
    "http": "h11", "sqlite_synchronous": "NORMAL",
    "policy_shadow_actions": "checkpoint,drain",
    "webhook_urls": "https://hooks.example/a,https://hooks.example/b",
    "webhook_slack_urls": "https://hooks.slack.example/x",
    "drain_command": "kubectl,cordon,{node}",
    "policy_probability": "xid_fatal=0.5,ecc_dbe=0.25",
    "dcgm_url": "http://dcgm.example:9400/metrics", "collector_url": "https://collector:9404",
    "uplink": "nats", "nats_url": "nats://nats1:4222,nats://nats2:4222",
    "bus_url": "nats://nats1:4222", "bus_stream_replicas": "3",
    "remote_write_labels": "cluster=a,region=b", "state": "postgresql",
    "remote_write_url": "http://vm.example:8428/api/v1/write",
}

SERVICES: dict[str, tuple[type[Any], list[str]]] = {
    "agent": (AgentConfig, ["agent"]),
    "collector": (CollectorConfig, ["collector", "run"]),
}


def other_value(key: str, hint: Any, default: Any) -> str:
    """A valid value for ``key`` that differs from its default, as a string."""
    if key in SPECIAL:
        return SPECIAL[key]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint
    if base is bool:
        return "false" if default else "true"
    if base in (int, float):
        return str(base(default * 2) if default else base(1))
    if base is Path:
        return f"/srv/forewarn-test/{key}"
    return f"value-{key}"


def flag_argv(key: str, value: str, hint: Any) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if hint is bool:
        return [flag] if value == "true" else ["--no-" + key.replace("_", "-")]
    return [flag, value]


@pytest.mark.parametrize("service", SERVICES)
def test_every_key_is_a_flag_and_an_env_var(service: str, tmp_path: Path) -> None:
    cls, command = SERVICES[service]
    hints = typing.get_type_hints(cls)
    defaults = cls()
    argv: list[str] = []
    env: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        value = other_value(f.name, hints[f.name], getattr(defaults, f.name))
        argv += flag_argv(f.name, value, hints[f.name])
        env[f"FOREWARN_{service.upper()}_{f.name.upper()}"] = value
    missing = tmp_path / "none.toml"
    by_flags = load_from_args(cls, service=service, default_path=missing, env={},
                              args=build_parser().parse_args([*command, *argv]))
    by_env = load_from_args(cls, service=service, default_path=missing, env=env,
                            args=build_parser().parse_args(command))
    assert by_flags == by_env
    for f in dataclasses.fields(cls):
        assert getattr(by_flags, f.name) != getattr(defaults, f.name), (
            f"{f.name}: neither the flag nor the variable changed it")


@pytest.mark.parametrize("service", SERVICES)
def test_help_shows_every_key_with_its_variable(service: str) -> None:
    cls, command = SERVICES[service]
    r = subprocess.run([sys.executable, "-m", "forewarn", *command, "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # argparse wraps long names across lines
    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in text, f"--help lacks the flag of {f.name}"
        assert f"FOREWARN_{service.upper()}_{f.name.upper()}" in text, (
            f"--help lacks the variable of {f.name}")


def test_collector_flags_work_before_and_after_run(tmp_path: Path) -> None:
    """`forewarn collector --data-dir D run` and `forewarn collector run --data-dir D`
    both work (the flags used to exist on `collector` only); a subcommand's flag wins."""
    parser = build_parser()
    missing = tmp_path / "none.toml"
    for argv in (["collector", "--data-dir", "/d1", "run"], ["collector", "run", "--data-dir",
                                                              "/d1"],
                 ["collector", "--data-dir", "/d0", "run", "--data-dir", "/d1"],
                 ["collector", "token", "list", "--data-dir", "/d1"]):
        config = load_from_args(CollectorConfig, service="collector", default_path=missing,
                                env={}, args=parser.parse_args(argv))
        assert config.data_dir == Path("/d1"), argv


def test_collector_run_serves_from_the_data_dir_its_flags_name(tmp_path: Path) -> None:
    """The command line of issue 13.10, run for real: `forewarn collector run --data-dir`
    was rejected; now the collector serves and keeps its database there."""
    port = free_port()
    data = tmp_path / "data"
    (tmp_path / "empty.toml").write_text("")
    proc = subprocess.Popen(
        [sys.executable, "-m", "forewarn", "collector", "run", "--config",
         str(tmp_path / "empty.toml"), "--data-dir", str(data),
         "--tokens-file", str(tmp_path / "tokens.toml"), "--listen", f"127.0.0.1:{port}",
         "--no-predictor-enabled", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def healthy() -> bool:
            if proc.poll() is not None:
                raise AssertionError(proc.communicate()[1])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for(healthy, START_TIMEOUT_S, "the collector's /healthz")
        assert (data / "collector.db").exists()
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
