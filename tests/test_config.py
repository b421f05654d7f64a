"""forewarn.config.load_config with AgentConfig: TOML, FOREWARN_AGENT_* environment,
flags (later wins); unknown keys and bad values are errors naming the key; the CLI turns
them into a one-line error and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from forewarn.agent.cli import config_from_args
from forewarn.agent.config import AgentConfig
from forewarn.cli import build_parser
from forewarn.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parent.parent


def load(tmp_path: Path, toml: str = "", env: dict[str, str] | None = None,
         **overrides: object) -> AgentConfig:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    return load_config(AgentConfig, service="agent", path=path, env=env or {},
                       overrides=overrides)


def test_defaults_without_file(tmp_path: Path) -> None:
    cfg = load_config(AgentConfig, service="agent", path=tmp_path / "missing.toml", env={})
    assert cfg.listen == "127.0.0.1:9403" and cfg.interval_s == 1.0 and cfg.source == "auto"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(AgentConfig, service="agent", path=tmp_path / "missing.toml",
                    required=True, env={})


def test_toml_then_env_then_flags(tmp_path: Path) -> None:
    toml = 'node = "gpu-7"\ninterval_s = 2\nsource = "sim"\nsim_gpus = 4\nkmsg = false\n'
    cfg = load(tmp_path, toml)
    assert (cfg.node, cfg.interval_s, cfg.source, cfg.sim_gpus, cfg.kmsg) == (
        "gpu-7", 2.0, "sim", 4, False)
    cfg = load(tmp_path, toml, env={"FOREWARN_AGENT_INTERVAL_S": "0.5",
                                    "FOREWARN_AGENT_KMSG": "yes",
                                    "OTHER_VAR": "ignored"})
    assert cfg.interval_s == 0.5 and cfg.kmsg is True and cfg.node == "gpu-7"
    cfg = load(tmp_path, toml, env={"FOREWARN_AGENT_INTERVAL_S": "0.5"}, interval_s=3.0,
               node=None)
    assert cfg.interval_s == 3.0, "flags win over the environment"
    assert cfg.node == "gpu-7", "an unset flag (None) changes nothing"


def test_paths_convert(tmp_path: Path) -> None:
    cfg = load(tmp_path, 'scenario = "/tmp/s.toml"\nkmsg_path = "/dev/null"\n')
    assert cfg.scenario == Path("/tmp/s.toml") and cfg.kmsg_path == Path("/dev/null")
    assert load(tmp_path, 'scenario = "none"\n').scenario is None


@pytest.mark.parametrize(("toml", "env", "needle"), [
    ("intervl_s = 1\n", {}, "unknown key 'intervl_s'"),
    ("", {"FOREWARN_AGENT_LISTN": "x"}, "FOREWARN_AGENT_LISTN: unknown key 'listn'"),
    # Type errors are msgspec's, after the origin and the key.
    ('interval_s = "fast"\n', {}, "agent.toml: interval_s: Expected `float`, got `str`"),
    ("sim_gpus = 1.5\n", {}, "agent.toml: sim_gpus: Expected `int`, got `float`"),
    ("kmsg = 3\n", {}, "agent.toml: kmsg: Expected `bool`, got `int`"),
    ("", {"FOREWARN_AGENT_KMSG": "maybe"},
     "environment FOREWARN_AGENT_KMSG: kmsg: Expected `bool`, got `str`"),
    ('source = "cuda"\n', {}, "source: must be one of"),
    ("interval_s = 0\n", {}, "interval_s: must be within"),
    ('listen = "9403"\n', {}, "listen: expected host:port"),
    ('hang_action = "kill"\n', {}, "hang_action"),
    ("sim_speed = -1\n", {}, "sim_speed: must be positive"),
    ("interval_s = [\n", {}, "not valid TOML"),
])
def test_errors_name_the_key(tmp_path: Path, toml: str, env: dict[str, str],
                             needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load(tmp_path, toml, env=env)


def test_flags_map_to_config_keys(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text('node = "from-file"\n')
    args = build_parser().parse_args([
        "agent", "--config", str(tmp_path / "a.toml"), "--source", "sim", "--interval",
        "0.25", "--listen", "127.0.0.1:9999", "--scenario", "/s.toml", "--sim-gpus", "2",
        "--sim-speed", "30", "--replay", "/r.csv", "--dcgm-url", "http://h:1/metrics",
        "--no-kmsg", "--kmsg-path", "/k", "--socket", "/run/x.sock", "--collector",
        "http://c:8080", "--token-file", "/t", "--node", "flag-node",
    ])
    cfg = config_from_args(args, env={})
    assert cfg.source == "sim" and cfg.interval_s == 0.25 and cfg.listen == "127.0.0.1:9999"
    assert cfg.scenario == Path("/s.toml") and cfg.sim_gpus == 2 and cfg.sim_speed == 30
    assert cfg.replay_path == Path("/r.csv") and cfg.dcgm_url == "http://h:1/metrics"
    assert cfg.kmsg is False and cfg.kmsg_path == Path("/k")
    assert cfg.socket_path == Path("/run/x.sock") and cfg.collector_url == "http://c:8080"
    assert cfg.token_file == Path("/t") and cfg.node == "flag-node"
    # Without --no-kmsg the file/env value stands.
    cfg = config_from_args(build_parser().parse_args(["agent", "--config",
                                                      str(tmp_path / "a.toml")]),
                           env={"FOREWARN_AGENT_KMSG": "false"})
    assert cfg.kmsg is False and cfg.node == "from-file"


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forewarn", "agent", *args],
                          capture_output=True, text=True, timeout=60, env=env)


def test_cli_config_errors_exit_2_with_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("interval_s = -3\n")
    r = run_cli("--config", str(bad))
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "interval_s" in lines[0] and "Traceback" not in r.stderr
    r = run_cli("--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "config file not found" in r.stderr
    scenario = tmp_path / "broken.toml"
    scenario.write_text("this is [not toml\n")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    r = run_cli("--source", "sim", "--scenario", str(scenario), "--config", str(empty))
    assert r.returncode == 2
    assert str(scenario) in r.stderr and "Traceback" not in r.stderr


def test_help_explains_every_flag() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in ("--config", "--source", "--interval", "--listen", "--scenario", "--sim-gpus",
                 "--sim-speed", "--replay", "--dcgm-url", "--no-kmsg", "--kmsg-path",
                 "--socket", "--collector", "--token-file", "--node", "--log-level"):
        assert flag in r.stdout


def test_example_config_loads_and_documents_every_key() -> None:
    import dataclasses

    example = ROOT / "deploy" / "agent.toml"
    cfg = load_config(AgentConfig, service="agent", path=example, required=True, env={})
    defaults = AgentConfig(node=cfg.node)
    assert cfg == defaults, "the example's values are the defaults"
    text = example.read_text()
    for f in dataclasses.fields(AgentConfig):
        assert f"{f.name} =" in text, f"deploy/agent.toml does not document {f.name}"


def test_collector_secret_file_it_cannot_read_exits_2_naming_the_key(tmp_path: Path) -> None:
    """An alert/operator/webhook secret file that cannot be read is a config error naming the
    key, not a traceback (it used to escape the CLI's error handling as an OSError)."""
    config = tmp_path / "collector.toml"
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n'
                      f'tokens_file = "{tmp_path / "tokens.toml"}"\n'
                      f'alert_token_file = "{tmp_path / "missing-alert-token"}"\n'
                      'predictor_enabled = false\n')
    r = subprocess.run([sys.executable, "-m", "forewarn", "collector", "--config",
                        str(config)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "alert_token_file" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(("service", "cls"), [("agent", "AgentConfig"),
                                             ("collector", "CollectorConfig")])
def test_config_modules_import_no_runtime_module(service: str, cls: str) -> None:
    """A config is data: loading and validating one imports nothing of the daemon (the
    collector's used to import the drain and webhook modules to check their settings)."""
    code = (f"import sys, forewarn.{service}.config as c; c.{cls}(); "
            "print(' '.join(sorted(n for n in sys.modules if n.startswith('forewarn'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    # forewarn.errors: the leaf module of the exception tree ConfigError belongs to.
    assert set(r.stdout.split()) == {"forewarn", "forewarn.config", "forewarn.errors",
                                     f"forewarn.{service}", f"forewarn.{service}.config"}, r.stdout


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--webhook-urls", "ftp://hooks.example/x", "webhook_urls"),
    ("--drain-command", "kubectl,cordon,{nodes}", "drain_command"),
])
def test_collector_action_settings_are_still_checked_at_start(
        tmp_path: Path, flag: str, value: str, needle: str) -> None:
    """Moved out of the config module, a bad webhook URL or drain template still stops
    the collector at start with one line naming the key (exit 2)."""
    r = subprocess.run([sys.executable, "-m", "forewarn", "collector", "run", "--data-dir",
                        str(tmp_path / "data"), "--tokens-file", str(tmp_path / "t.toml"),
                        "--listen", "127.0.0.1:0", "--no-predictor-enabled", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr
