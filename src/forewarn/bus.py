"""The NATS JetStream bus between agents and collectors: names, identities, permissions.

One fact, one place: the agent (:mod:`forewarn.agent.bus`) and the collector
(:mod:`forewarn.collector.ingest.bus`) both take their subjects, stream and consumer
names from here. This module imports nothing of ``nats``: ``forewarn collector nats-auth``
and the docs use it without the client installed.

Subjects (``<n>`` is the node's *subject token*, :func:`node_token`):

* ``forewarn.batch.<n>``: the agent's :class:`~forewarn.wire.AgentBatch`\\ es, msgpack (the
  same bytes as ``POST /api/v1/ingest``), header ``Nats-Msg-Id: <agent_id>:<seq>`` so
  JetStream drops a re-publish inside its duplicate window. Stream :data:`BATCH_STREAM`
  (limits by age and bytes); every collector replica pulls through ONE durable consumer,
  :data:`BATCH_CONSUMER`, so each batch is stored by one replica; the leader alone also
  pulls the whole stream through :data:`DECIDE_CONSUMER` for its decisions.
* ``forewarn.urgent.<n>``: the agent's *urgent* batches (``AgentBatch.urgent``: a finding
  or a checkpoint report in it), the same bytes and header, in the same stream: the urgent
  lane. The collectors store them through :data:`URGENT_CONSUMER` and the leader decides
  on them through :data:`DECIDE_URGENT_CONSUMER`, each pulled beside (not behind) its
  telemetry consumer, so a fatal finding never waits for a telemetry backlog.
* ``forewarn.cmd.<n>``: :class:`~forewarn.wire.Command`\\ s for that node (JSON), header
  ``Nats-Msg-Id: <command id>``. Stream :data:`COMMAND_STREAM` (work queue); the agent
  pulls through its own durable consumer, :func:`command_consumer`, and acknowledges a
  command only after it published its answer, so an unanswered command comes again.
* ``forewarn.ack.<n>``: the agent's :class:`~forewarn.wire.CommandAck` (JSON), in
  :data:`COMMAND_STREAM` too; the collectors pull them through :data:`ACK_CONSUMER`.

Identity: the subject *is* the node's identity. The collector trusts ``<n>`` because
nats-server lets each node's user publish only its own subjects (:func:`authorization`);
a batch naming another node is refused exactly as over HTTP.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping

__all__ = [
    "ACK_CONSUMER",
    "ACK_PREFIX",
    "BATCH_CONSUMER",
    "BATCH_PREFIX",
    "BATCH_STREAM",
    "BUS_ADDRESS",
    "COLLECTOR_USER",
    "COMMAND_PREFIX",
    "COMMAND_STREAM",
    "DECIDE_CONSUMER",
    "DECIDE_URGENT_CONSUMER",
    "URGENT_CONSUMER",
    "URGENT_PREFIX",
    "authorization",
    "check_url",
    "command_consumer",
    "inbox_prefix",
    "nats_password",
    "node_of",
    "node_token",
    "servers",
    "subject",
]

BATCH_STREAM = "FOREWARN_BATCHES"
COMMAND_STREAM = "FOREWARN_COMMANDS"
BATCH_PREFIX = "forewarn.batch"
URGENT_PREFIX = "forewarn.urgent"
COMMAND_PREFIX = "forewarn.cmd"
ACK_PREFIX = "forewarn.ack"
BATCH_CONSUMER = "collectors"
"""The one durable pull consumer every collector replica shares (work-queue style)."""
DECIDE_CONSUMER = "decide"
"""The durable pull consumer of the telemetry lane that only the leader pulls."""
URGENT_CONSUMER = "collectors-urgent"
"""The urgent lane's :data:`BATCH_CONSUMER`: shared by every replica, for storage."""
DECIDE_URGENT_CONSUMER = "decide-urgent"
"""The urgent lane's :data:`DECIDE_CONSUMER`: the leader's alone."""
BUS_ADDRESS = "nats"
"""The address a collector records for a batch that came over the bus (not over HTTP)."""
ACK_CONSUMER = "collectors-acks"
COLLECTOR_USER = "forewarn-collector"

_SAFE = re.compile(r"[A-Za-z0-9-]")
_ESCAPE = re.compile(r"__|_([0-9A-F]{2})")


def node_token(node: str) -> str:
    """``node`` as one NATS subject token and consumer name, made of letters, digits,
    ``-`` and ``_`` only: ``_`` is written ``__`` and every other byte ``_XX`` (hex). A
    hostname's dots would split the subject, and nats-server 2.9 does not serve a pull
    consumer whose name holds ``%``; the mapping is one to one (``gpu.7`` ->
    ``gpu_2E7``)."""
    out = []
    for c in node:
        if _SAFE.fullmatch(c):
            out.append(c)
        elif c == "_":
            out.append("__")
        else:
            out.extend(f"_{b:02X}" for b in c.encode())
    return "".join(out)


def node_of(token: str) -> str:
    """The node name a subject token stands for (inverse of :func:`node_token`);
    raises ``ValueError`` on a token :func:`node_token` cannot produce."""
    raw = _ESCAPE.sub(lambda m: "%5F" if m.group(0) == "__" else f"%{m.group(1)}", token)
    if not re.fullmatch(r"(?:[A-Za-z0-9-]|%[0-9A-F]{2})*", raw):
        raise ValueError(f"not a node subject token: {token!r}")
    data = bytearray()
    for part in re.findall(r"%[0-9A-F]{2}|[A-Za-z0-9-]", raw):
        data.extend(bytes.fromhex(part[1:]) if part.startswith("%") else part.encode())
    try:
        node = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"not a node subject token: {token!r}") from None
    if not node or node_token(node) != token:
        raise ValueError(f"not a node subject token: {token!r}")
    return node


def subject(prefix: str, node: str) -> str:
    """The subject of ``node`` under ``prefix`` (``forewarn.batch.gpu-07``)."""
    return f"{prefix}.{node_token(node)}"


def command_consumer(node: str) -> str:
    """The durable consumer through which ``node``'s agent pulls its commands."""
    return f"cmd-{node_token(node)}"


def inbox_prefix(node: str) -> str:
    """Reply subjects of ``node``'s connection: its own, so no node reads another's
    JetStream answers (``_INBOX.>`` would let it)."""
    return f"_INBOX_{node_token(node)}"


def nats_password(token: str) -> str:
    """A node's NATS password, derived from its collector token: the hex SHA-256 the
    collector's tokens file holds. So enrolling a node (``forewarn collector token add``)
    is all it takes, and the token itself never leaves the agent; the tokens file and the
    generated nats-server config are secrets (mode 0600) like any plain-password
    nats-server config."""
    return hashlib.sha256(token.encode()).hexdigest()


def _node_permissions(node: str) -> dict[str, object]:
    """What ``node``'s NATS user may do: publish its batches (both lanes) and command
    answers, pull its own command consumer, read its own inbox; nothing else."""
    tok = node_token(node)
    consumer = command_consumer(node)
    cmd_subject = f"{COMMAND_PREFIX}.{tok}"
    return {
        "publish": {"allow": [
            f"{BATCH_PREFIX}.{tok}",
            f"{URGENT_PREFIX}.{tok}",
            f"{ACK_PREFIX}.{tok}",
            f"$JS.API.CONSUMER.CREATE.{COMMAND_STREAM}.{consumer}.{cmd_subject}",
            f"$JS.API.CONSUMER.INFO.{COMMAND_STREAM}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{COMMAND_STREAM}.{consumer}",
            f"$JS.ACK.{COMMAND_STREAM}.{consumer}.>",
        ]},
        "subscribe": {"allow": [f"{inbox_prefix(node)}.>"]},
    }


def authorization(node_hashes: Mapping[str, str], collector_password: str) -> str:
    """The nats-server ``authorization { users = [...] }`` block for these nodes.

    ``node_hashes`` maps node -> ``sha256:<hex>`` (the collector's tokens file); each node
    gets user :func:`node_token` with password :func:`nats_password` of its token and the
    permissions of :func:`_node_permissions`. The collector's user
    (:data:`COLLECTOR_USER`) may do everything. The values are JSON strings, which the
    nats-server config format reads as quoted strings."""
    users: list[dict[str, object]] = [
        {"user": COLLECTOR_USER, "password": collector_password}]
    for node in sorted(node_hashes):
        digest = node_hashes[node].removeprefix("sha256:")
        users.append({"user": node_token(node), "password": digest,
                      "permissions": _node_permissions(node)})
    lines = ["authorization {", "  users = ["]
    lines.extend(f"    {json.dumps(u, sort_keys=True)}" for u in users)
    lines.extend(["  ]", "}", ""])
    return "\n".join(lines)


def servers(url: str) -> list[str]:
    """The server URLs of a comma-separated ``nats_url`` (``nats://h1:4222,nats://h2:4222``)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def check_url(key: str, url: str) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``url`` lists nats:// or tls:// URLs."""
    urls = servers(url)
    if not urls:
        raise ValueError(f"{key}: expected nats://host:port (comma-separated for a cluster)")
    for u in urls:
        if not re.fullmatch(r"(nats|tls)://[^\s/]+:\d+", u):
            raise ValueError(f"{key}: expected nats://host:port, got {u!r}")

