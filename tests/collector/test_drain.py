"""Drain: argument-list templates, validated values, no shell; injection attempts run nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from forewarn.collector.decide.drain import DrainError, DrainRunner, DrainTemplate, sanitize_reason

SCONTROL = ["scontrol", "update", "nodename={node}", "state=drain", "reason={reason}"]


def recorder(tmp_path: Path) -> list[str]:
    """A real program that appends its arguments to a file: what would have run."""
    script = tmp_path / "record.py"
    script.write_text(
        "import sys, pathlib\n"
        f"p = pathlib.Path({str(tmp_path / 'ran.txt')!r})\n"
        "p.write_text(p.read_text() + '\\x1f'.join(sys.argv[1:]) + '\\n' if p.exists() "
        "else '\\x1f'.join(sys.argv[1:]) + '\\n')\n"
    )
    return [sys.executable, str(script)]


def ran(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "ran.txt"
    if not path.exists():
        return []
    return [line.split("\x1f") for line in path.read_text().splitlines()]


def test_renders_scontrol_and_kubectl() -> None:
    t = DrainTemplate(tuple(SCONTROL))
    assert t.render("gpu-node-07", "XID 79 on GPU 3") == [
        "scontrol", "update", "nodename=gpu-node-07", "state=drain", "reason=XID 79 on GPU 3"]
    assert DrainTemplate(("kubectl", "cordon", "{node}")).render("n1.cluster", "x") == [
        "kubectl", "cordon", "n1.cluster"]
    # literal braces stay literal
    assert DrainTemplate(("echo", "{{node}}={node}")).render("a", "")[1] == "{node}=a"


@pytest.mark.parametrize("arg", [
    "{node.__class__}", "{node.__class__.__init__.__globals__}", "{0}", "{}", "{node[0]}",
    "{node!r}", "{node:>300}", "{node:{reason}}", "{reason.upper}", "{nodes}", "{node", "}",
    "{__import__}",
])
def test_template_injection_rejected(arg: str) -> None:
    with pytest.raises(DrainError):
        DrainTemplate(("scontrol", arg, "{node}"))


def test_template_must_name_node_and_program_is_fixed() -> None:
    with pytest.raises(DrainError, match="must name the node"):
        DrainTemplate(("scontrol", "update"))
    with pytest.raises(DrainError, match="program"):
        DrainTemplate(("{node}", "x"))
    with pytest.raises(DrainError, match="empty"):
        DrainTemplate(())


@pytest.mark.parametrize("node", [
    "n1; rm -rf /", "n1 && reboot", "$(reboot)", "`id`", "n1|cat", "--all", "-n1", ".hidden",
    "n1\nn2", "n1 n2", "", "a" * 300, "n1/../x", "{node}", "n1>out",
])
def test_bad_node_names_rejected_nothing_run(node: str, tmp_path: Path) -> None:
    runner = DrainRunner([*recorder(tmp_path), "{node}", "--", "{reason}"], enabled=True)
    with pytest.raises(DrainError, match="invalid node name"):
        runner.run(node, "reason")
    assert ran(tmp_path) == []


def test_reason_sanitized() -> None:
    assert sanitize_reason("XID 79; rm -rf / $(id) `x` | y > z {node}") == (
        "XID 79 rm -rf / id x y z node")
    assert sanitize_reason("force  now ") == "force now"
    assert len(sanitize_reason("x" * 1000)) == 128
    assert sanitize_reason(";;;") == "forewarn"


def test_runs_argument_list_without_shell(tmp_path: Path) -> None:
    runner = DrainRunner([*recorder(tmp_path), "nodename={node}", "reason={reason}"],
                         enabled=True, timeout_s=30)
    result = runner.run("node-2", "GPU 3 fell off the bus; $(reboot)")
    assert result.ran and result.returncode == 0 and not result.shadow
    # one argument each, shell metacharacters removed from the reason, nothing expanded
    assert ran(tmp_path) == [["nodename=node-2", "reason=GPU 3 fell off the bus reboot"]]


def test_off_by_default_renders_but_runs_nothing(tmp_path: Path) -> None:
    runner = DrainRunner([*recorder(tmp_path), "{node}"])
    result = runner.run("node-2", "r")
    assert result.shadow and not result.ran and result.argv[-1] == "node-2"
    assert ran(tmp_path) == []


def test_timeout_and_missing_program_reported(tmp_path: Path) -> None:
    slow = DrainRunner([sys.executable, "-c", "import time; time.sleep(30)", "{node}"],
                       enabled=True, timeout_s=0.5)
    result = slow.run("n1", "r")
    assert result.returncode is None and "timed out" in result.error
    missing = DrainRunner([str(tmp_path / "no-such-program"), "{node}"], enabled=True)
    result = missing.run("n1", "r")
    assert not result.ran and "FileNotFoundError" in result.error


@pytest.mark.parametrize("reason", [
    "- --all", "--all", "  -rf", ";--all", "-", "ok\n--all", "x\x1b[2J", "a\x00b", "a\rb",
    "tab\there", "a\u2028b", "del\x7f",
])
def test_reason_that_could_be_an_option_or_has_control_characters_is_refused(
        reason: str, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    runner = DrainRunner([*recorder(tmp_path), "{node}", "--", "{reason}"], enabled=True)
    runner.register(registry)
    with pytest.raises(DrainError, match=r"refusing to drain n1: reason "):
        runner.run("n1", reason)
    assert ran(tmp_path) == []
    assert registry.get_sample_value("forewarn_collector_drain_refused_total",
                                     {"slot": "reason"}) == 1
    with pytest.raises(DrainError, match="invalid node name"):
        runner.run("--all", "fine")
    assert registry.get_sample_value("forewarn_collector_drain_refused_total",
                                     {"slot": "node"}) == 1


@pytest.mark.parametrize("argv", [
    ("prog", "{node}", "{reason}"), ("prog", "{reason}", "{node}"),
    ("prog", "{node}", "{reason}-x"), ("prog", "{node}", "{reason}", "--"),
])
def test_free_text_slot_must_be_an_option_value_or_follow_double_dash(
        argv: tuple[str, ...]) -> None:
    """``{reason}`` is free text: it may only be the value of an option (``--reason=``,
    ``reason=``) or an operand after ``--``, never a whole argument that a program could
    take for an option."""
    with pytest.raises(DrainError, match="free text"):
        DrainTemplate(argv)


def test_free_text_slot_as_option_value_or_after_double_dash_renders(tmp_path: Path) -> None:
    for argv in (("prog", "--reason={reason}", "{node}"), ("prog", "{node}", "--", "{reason}"),
                 ("prog", "reason={reason}", "{node}")):
        assert DrainTemplate(argv).render("n1", "XID 79")[-2:] in (
            ["--reason=XID 79", "n1"], ["--", "XID 79"], ["reason=XID 79", "n1"])
