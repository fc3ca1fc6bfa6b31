"""DevPlane: the gateway's half of the session, the JoinService, the worker and approvers, the broker.

A trio service (`await nursery.start(plane.run)`); grpclib serves under trio-asyncio and each session
stream is handled by trio code (`trio_as_aio`). State lives in `Store` (SQLite), so a restarted plane
carries on where the killed one stopped. The rules it follows (seeds/delivery.md; docs/devplane.md):

- Hello: a new epoch; Welcome{server_time, epoch, trust bundle}; the full spec when `generation` is above
  the node's applied generation (DLV-RCV-01), relayed as stored (DLV-RCV-17); Hello's unacked results
  stored and acked; in-flight commands redelivered (the node's journal deduplicates); cancels re-sent.
- A new generation is pushed at once (DLV-RCV-02); every 10 s the backstop sends the full spec to a session
  behind both what the node holds and what was sent on it (DLV-RCV-03); SpecRequest is answered (DLV-RCV-05).
- Commands: pending ones with `not_before <= now < not_after` are dispatched in seq order within lane credits
  (control 8, provision 4, bulk 2); a cancel before dispatch wins (DLV-CAN-01); an in-flight one gets
  `Cancel` once per session and after every reconnect (DLV-CAN-02).
- Updates move a command forward only, scoped to the reporting node (DLV-RES-09); a terminal one is stored
  exactly as received (DLV-RES-10) and acked in `Ack.command_ids`, also when stored earlier or unknown
  (DLV-RES-11). BUSY puts the command back to pending for a second.
- Events above the node's cumulative ack for its current journal are stored, the ack advanced, and
  `Ack{journal_id, event_seq}` answered (DLV-EVT-05/07); a batch for another journal is ignored (DLV-EVT-08).
- The sweeper (every 5 s): pending past not_after -> expired; in flight past not_after + the kind's timeout
  -> failed `timeout` (DLV-TMO-01..06; timeouts from dispatch.kinds.timeout_for).
- Secrets are released only while the node's current spec names the reference.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import secrets
import ssl
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from attrs import define, field
from bcd_shared import wire
from bcd_shared.pki import issue_node_certificate, sign_join_response
from bcd_shared.pki.chain import Roots, verify_chain
from bcd_shared.pki.errors import PkiError
from bcd_shared.pki.quorum import approve, build_batch
from bcd_shared.pki.signing import Purpose
from bcd_shared.wire.kinds import KIND_MESSAGES
from bcd_shared.wire.strict import type_url

from bcd_agent.devplane import keys as keysmod
from bcd_agent.devplane.store import TERMINAL, Store, log_update_in
from bcd_agent.dispatch.kinds import KINDS, KindSpec, Lane
from bcd_agent.kinds.testing import TEST_KINDS

log = logging.getLogger("bcd.devplane")

BACKSTOP_S = 10.0
SWEEP_S = 5.0
DISPATCH_S = 1.0
HEARTBEAT_MS = 10_000
LANE_CREDITS = {Lane.CONTROL: 8, Lane.PROVISION: 4, Lane.BULK: 2}
# Pending rows read beyond a lane's free credits, for the invalid bodies dispatch skips (cancels).
_SKIP_ALLOWANCE = 8
_WIRE_LANES = {
    Lane.CONTROL: wire.Lane.CONTROL,
    Lane.PROVISION: wire.Lane.PROVISION,
    Lane.BULK: wire.Lane.BULK,
}
_STATE_NAMES = {
    wire.CommandState.ACKED: "acked",
    wire.CommandState.RUNNING: "running",
    wire.CommandState.SUCCEEDED: "succeeded",
    wire.CommandState.FAILED: "failed",
    wire.CommandState.REJECTED: "rejected",
    wire.CommandState.CANCELLED: "cancelled",
    wire.CommandState.BUSY: "busy",
}
_ORDER = {"pending": 0, "dispatched": 1, "acked": 2, "running": 3}
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_ulid(now: float | None = None) -> str:
    ms = int((time.time() if now is None else now) * 1000)
    value = (ms << 80) | int.from_bytes(os.urandom(10), "big")
    return "".join(_CROCKFORD[(value >> (5 * i)) & 31] for i in reversed(range(26)))


def canonical_json(spec: wire.NodeSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def spec_from_json(doc: Mapping[str, Any]) -> wire.NodeSpec:
    """A NodeSpec from protobuf's JSON mapping, with the strict reader `bcd plan` and `bcd sim` use: an
    unknown key or a wrong type is refused naming the field. Not betterproto's from_dict, which misnames
    `hugepages_2mi` (examples/gpu-node.json's `hugepages2mi` was refused as `hugepages2_mi`)."""
    from bcd_agent.plan import parse_spec_json

    return parse_spec_json(json.dumps(dict(doc)), "spec")


K8S_JOIN_WORKFLOW = "host:k8s-join"
K8S_JOIN_STEP = "tokenRef"
TELEMETRY_WORKFLOW = "telemetry"
TELEMETRY_STEP = "headers_secret_ref"


def _strings(value: object) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_strings(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(_strings(v) for v in value)) if value else set()
    return set()


def _host_settings(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """(unit name, decoded settings) of the spec's host units (settings travel as JSON text)."""
    host = spec.get("host") if isinstance(spec, dict) else None
    units = host.get("units", []) if isinstance(host, dict) else []
    out: list[tuple[str, Any]] = []
    for unit in units if isinstance(units, list) else []:
        if not isinstance(unit, dict):
            continue
        try:
            settings = json.loads(unit.get("settings") or "null")
        except ValueError:
            settings = None
        out.append((str(unit.get("name", "")), settings))
    return out


def _names_secret(spec: dict[str, Any], request: wire.SecretRequest) -> bool:
    """The broker's binding rule: the node's current spec names `request.ref`. A request for the k8s-join
    token (workflow `host:k8s-join`, step `tokenRef`) must find it in that unit's `tokenRef` (HST-K8S-51);
    any other request in any string of the spec, host unit settings included. The telemetry headers
    (workflow `telemetry`, step `headers_secret_ref`) must be the telemetry section's `headersSecretRef`."""
    if request.workflow_id == TELEMETRY_WORKFLOW:
        telemetry = spec.get("telemetry")
        return (
            request.step_id == TELEMETRY_STEP
            and isinstance(telemetry, dict)
            and telemetry.get("headersSecretRef") == request.ref
        )
    if request.workflow_id == K8S_JOIN_WORKFLOW:
        return request.step_id == K8S_JOIN_STEP and any(
            name == "k8s-join" and isinstance(s, dict) and s.get("tokenRef") == request.ref
            for name, s in _host_settings(spec)
        )
    named = _strings(spec)
    for _name, settings in _host_settings(spec):
        named |= _strings(settings)
    return request.ref in named


@define
class GatewaySession:
    node_id: str
    epoch: int
    send: trio.MemorySendChannel[wire.GatewayMessage]
    applied_generation: int = 0
    sent_generation: int = 0
    cancels_sent: set[str] = field(factory=set)
    closed: bool = False

    def out(self, message: wire.GatewayMessage) -> None:
        if not self.closed:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                self.send.send_nowait(message)


class DevPlane:
    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        listen: str | None = "127.0.0.1:0",
        unix_socket: str | os.PathLike[str] | None = None,
        backstop_s: float = BACKSTOP_S,
        sweep_s: float = SWEEP_S,
        test_kinds: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        self.listen = listen
        self.unix_socket = Path(unix_socket) if unix_socket is not None else None
        self.backstop_s = backstop_s
        self.sweep_s = sweep_s
        self.kinds: dict[str, KindSpec] = {**KINDS, **(TEST_KINDS if test_kinds else {})}
        self.keys = keysmod.load_or_create(self.directory, dt.datetime.now(dt.UTC))
        self.store = Store(self.directory)
        self.sessions: dict[str, GatewaySession] = {}
        self.address: tuple[str, int] | None = None
        self._poke = trio.Event()
        # Bodies `enqueue` built (valid by construction) -> their node: `dispatch` re-checks a stored body
        # (DLV-CMD-17) by decoding it only when its bytes are not these (changed in the store, or
        # enqueued by an earlier process). Bounded: cleared past _KNOWN_BODIES_MAX.
        self._known_bodies: dict[bytes, str] = {}
        self.ca_pem_path = self.directory / "ca.pem"
        if not self.ca_pem_path.exists():
            self.ca_pem_path.write_bytes(self.keys.ca_pem())

    @property
    def admin_path(self) -> Path:
        return self.directory / "admin.sock"

    @property
    def join_pin(self) -> str:
        return str(self.keys.join_pin)

    # --- the service ---------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[DevPlane] = trio.TASK_STATUS_IGNORED) -> None:
        from bcd_agent.devplane import admin, server

        try:
            async with server.serving(self) as bound:
                self.address = bound
                self._write_endpoint()
                async with trio.open_nursery() as nursery:
                    await nursery.start(admin.serve, self)
                    nursery.start_soon(self._timers)
                    log.info(
                        "devplane: serving on %s, %s; admin socket %s",
                        f"{bound[0]}:{bound[1]} (mutual TLS)" if bound else "no TCP listener",
                        f"unix {self.unix_socket}" if self.unix_socket else "no Unix socket",
                        self.admin_path,
                    )
                    task_status.started(self)
        finally:
            self.store.close()

    def _write_endpoint(self) -> None:
        doc = {
            "address": f"{self.address[0]}:{self.address[1]}" if self.address else None,
            "unix_socket": str(self.unix_socket) if self.unix_socket else None,
            "ca_file": str(self.ca_pem_path),
            "join_pin": self.join_pin,
            "pid": os.getpid(),
        }
        (self.directory / "endpoint.json").write_text(json.dumps(doc, indent=1) + "\n")

    async def _timers(self) -> None:
        last_backstop = last_sweep = trio.current_time()
        while True:
            with trio.move_on_after(DISPATCH_S):
                await self._poke.wait()
            self._poke = trio.Event()
            now = trio.current_time()
            if now - last_sweep >= self.sweep_s:
                self.sweep()
                last_sweep = now
            if now - last_backstop >= self.backstop_s:
                self.backstop()
                last_backstop = now
            for session in list(self.sessions.values()):
                self.dispatch(session)

    def poke(self) -> None:
        self._poke.set()

    # --- join ---------------------------------------------------------------------------------------

    def issue_token(self) -> str:
        # Hex, not URL-safe base64: one such token in 64 began with '-', and `bcd join --token TOKEN`
        # (as the docs write it) then read it as an option.
        token = secrets.token_hex(24)
        with self.store.tx() as c:
            c.execute("INSERT INTO tokens (token, created_at) VALUES (?, ?)", (token, time.time()))
        return token

    def join(self, request: wire.JoinRequest) -> wire.JoinResponse:
        """The JoinService: a one-time token, the node's key (and its CSR) -> certificate + trust bundle."""
        if len(request.node_public_key) != 32:
            raise PermissionError("node_public_key: an Ed25519 key is 32 bytes")
        if request.csr:
            _check_csr(bytes(request.csr), bytes(request.node_public_key))
        with self.store.tx() as c:
            row = c.execute("SELECT used_at FROM tokens WHERE token = ?", (request.token,)).fetchone()
            if row is None or row[0] is not None:
                raise PermissionError("join token unknown or already used")
            node_id = request.node_id or f"node-{secrets.token_hex(4)}"
            now = dt.datetime.now(dt.UTC)
            ca = self.keys.key("node_ca")
            cert = issue_node_certificate(
                self.keys.node_ca_der, ca, bytes(request.node_public_key), node_id,
                now - dt.timedelta(minutes=5), now + dt.timedelta(days=365),
            )  # fmt: skip
            c.execute(
                "UPDATE tokens SET used_at = ?, node_id = ? WHERE token = ?",
                (time.time(), node_id, request.token),
            )
            c.execute(
                "INSERT INTO nodes (node_id, public_key, certificate, hostname, joined_at) VALUES (?, ?,"
                " ?, ?, ?)"
                " ON CONFLICT (node_id) DO UPDATE SET public_key = excluded.public_key,"
                " certificate = excluded.certificate, hostname = excluded.hostname",
                (node_id, bytes(request.node_public_key), cert, request.hostname, time.time()),
            )
        body = wire.JoinResponseBody(
            node_id=node_id,
            certificate_chain=[cert],
            trust_bundle=self.keys.signed_trust_bundle(),
            issued_at=int(time.time() * 1000),
        )
        data = sign_join_response(self.keys.key("join"), body)
        return wire.JoinResponse.parse(data)

    # --- specs --------------------------------------------------------------------------------------

    def default_node(self) -> str:
        rows = self.store.all("SELECT node_id FROM nodes ORDER BY joined_at")
        if len(rows) != 1:
            raise LookupError(f"name the node: {len(rows)} nodes joined ({[r[0] for r in rows]})")
        return str(rows[0][0])

    def apply_spec(self, node_id: str, spec: wire.NodeSpec | Mapping[str, Any]) -> int:
        """Store `spec` as the node's desired state. A new generation (signed by the worker key) only when
        the canonical JSON differs from the stored spec; pushed to the node's session at once."""
        if not isinstance(spec, wire.NodeSpec):
            spec = spec_from_json(spec)
        text = canonical_json(spec)
        with self.store.tx() as c:
            row = c.execute(
                "SELECT generation, spec_json FROM nodes WHERE node_id = ?", (node_id,)
            ).fetchone()
            if row is None:
                raise LookupError(f"node {node_id!r} has not joined")
            if row["spec_json"] == text and row["generation"] > 0:
                return int(row["generation"])
            generation = int(row["generation"]) + 1
            spec_hash = hashlib.sha256(text.encode()).hexdigest()
            body = bytes(
                wire.DesiredStateBody(node_id=node_id, generation=generation, spec_hash=spec_hash, full=spec)
            )
            signature = self.keys.key("worker").sign(Purpose.DESIRED_STATE, body)
            c.execute(
                "UPDATE nodes SET generation = ?, spec_json = ?, spec_body = ?, spec_signature = ?,"
                " spec_hash = ?"
                " WHERE node_id = ?",
                (generation, text, body, signature, spec_hash, node_id),
            )
        session = self.sessions.get(node_id)
        if session is not None:
            self.send_spec(session)
        return generation

    def desired_state(self, node_id: str) -> tuple[int, wire.DesiredState] | None:
        row = self.store.one(
            "SELECT generation, spec_json, spec_hash, spec_body, spec_signature FROM nodes WHERE node_id = ?",
            node_id,
        )
        if row is None or not row["generation"]:
            return None
        generation = int(row["generation"])
        if row["spec_body"] is None:
            # No encoded body stored: render the stored spec unsigned with apply_spec's own encoder,
            # byte for byte (DLV-RCV-18).
            body = bytes(
                wire.DesiredStateBody(
                    node_id=node_id,
                    generation=generation,
                    spec_hash=str(row["spec_hash"]),
                    full=spec_from_json(json.loads(row["spec_json"] or "{}")),
                )
            )
            return generation, wire.DesiredState(body=body)
        envelope = wire.DesiredState(
            body=bytes(row["spec_body"]),
            signature=bytes(row["spec_signature"] or b""),
            signer_chain=[self.keys.worker_der] if row["spec_signature"] else [],
        )
        return generation, envelope

    def send_spec(self, session: GatewaySession) -> bool:
        current = self.desired_state(session.node_id)
        if current is None:
            return False
        generation, envelope = current
        session.out(wire.GatewayMessage(desired_state=envelope))
        session.sent_generation = max(session.sent_generation, generation)
        return True

    def backstop(self) -> None:
        for session in list(self.sessions.values()):
            row = self.store.one("SELECT generation FROM nodes WHERE node_id = ?", session.node_id)
            if row is not None and row[0] > max(session.applied_generation, session.sent_generation):
                self.send_spec(session)

    # --- commands -----------------------------------------------------------------------------------

    def enqueue(
        self,
        node_id: str,
        kind: str,
        payload: wire.ProtoAny | None = None,
        *,
        not_after_s: float = 300.0,
        min_generation: int = 0,
        not_before: float = 0.0,
        batch: bool | None = None,
    ) -> str:
        """Sign and queue a command; destructive kinds get a one-leaf batch approved by 2 of 3 approvers."""
        spec = self.kinds.get(kind)
        lane = spec.lane if spec is not None else Lane.CONTROL
        command_id = new_ulid()
        with self.store.tx() as c:
            row = c.execute("SELECT next_cmd_seq FROM nodes WHERE node_id = ?", (node_id,)).fetchone()
            if row is None:
                raise LookupError(f"node {node_id!r} has not joined")
            seq = int(row[0])
            c.execute("UPDATE nodes SET next_cmd_seq = ? WHERE node_id = ?", (seq + 1, node_id))
            destructive = spec is not None and spec.destructive
            batched = destructive if batch is None else batch
            body_msg = wire.CommandBody(
                id=command_id,
                node_id=node_id,
                seq=seq,
                kind=kind,
                payload=payload,
                lane=_WIRE_LANES[lane],
                not_after=int((time.time() + not_after_s) * 1000),
                min_generation=min_generation,
                retry_safe=bool(spec and spec.retry_safe),
                idempotency_key=command_id,
                self_terminating=bool(spec and spec.self_terminating),
                attested=bool(spec and spec.attested),
                batch_id=f"batch-{command_id}" if batched else "",
            )
            body = bytes(body_msg)
            if body_msg.not_after > 0:
                if len(self._known_bodies) >= _KNOWN_BODIES_MAX:
                    self._known_bodies.clear()
                self._known_bodies[body] = node_id
            signature = self.keys.key("worker").sign(Purpose.COMMAND, body)
            approval = proof = None
            if batched:
                approval, proof = self._batch(body_msg)
            c.execute(
                "INSERT INTO commands (id, node_id, seq, kind, lane, body, signature, signer_chain,"
                " approval, proof,"
                " state, not_after_ms, timeout_s, retry_safe, not_before, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', ?, ?, ?, ?, ?, ?)",
                (
                    command_id, node_id, seq, kind, lane.value, body, signature, self.keys.worker_der,
                    approval, proof, body_msg.not_after, _timeout(spec), int(body_msg.retry_safe), not_before,
                    time.time(), time.time(),
                ),
            )  # fmt: skip
        self.poke()
        return command_id

    def _batch(self, body: wire.CommandBody) -> tuple[bytes, bytes]:
        payload_value = bytes(body.payload.value) if body.payload else b""
        leaf = wire.BatchLeaf(
            subject=body.target_node_id or body.node_id,
            kind=body.kind,
            payload_sha256=hashlib.sha256(payload_value).digest(),
            command_id=body.id,
        )
        built = build_batch(
            body.batch_id, [leaf], description=f"devplane {body.kind}", not_after_ms=body.not_after
        )
        signatures = [approve(self.keys.key(n), n, built.scope) for n in ("a1", "a2")]
        approval = wire.BatchApproval(scope=built.scope, signatures=signatures)
        return bytes(approval), bytes(built.proof(0))

    def cancel(self, command_id: str, reason: str = "cancelled by the operator") -> str:
        """Request a cancel: a pending command is cancelled and never sent (DLV-CAN-01); an in-flight one
        is sent Cancel on its node's session (DLV-CAN-02)."""
        with self.store.tx() as c:
            row = c.execute("SELECT node_id, state FROM commands WHERE id = ?", (command_id,)).fetchone()
            if row is None:
                raise LookupError(f"command {command_id} unknown")
            state = str(row["state"])
            if state in TERMINAL:
                return state
            if state == "pending":
                c.execute(
                    "UPDATE commands SET state = 'cancelled', reason = ?, cancel_requested = 1,"
                    " cancel_reason = ?,"
                    " updated_at = ? WHERE id = ?",
                    (reason, reason, time.time(), command_id),
                )
                return "cancelled"
            c.execute(
                "UPDATE commands SET cancel_requested = 1, cancel_reason = ? WHERE id = ?",
                (reason, command_id),
            )
        session = self.sessions.get(str(row["node_id"]))
        if session is not None:
            self.send_cancels(session)
        return state

    def send_cancels(self, session: GatewaySession) -> None:
        rows = self.store.all(
            "SELECT id, cancel_reason FROM commands WHERE node_id = ? AND cancel_requested = 1"
            " AND state IN ('dispatched', 'acked', 'running')",
            session.node_id,
        )
        for row in rows:
            if row["id"] not in session.cancels_sent:
                session.cancels_sent.add(row["id"])
                session.out(
                    wire.GatewayMessage(cancel=wire.Cancel(command_id=row["id"], reason=row["cancel_reason"]))
                )

    def _command_message(self, row: Any) -> wire.GatewayMessage:
        return wire.GatewayMessage(
            command=wire.Command(
                body=bytes(row["body"]),
                signature=bytes(row["signature"]),
                signer_chain=[bytes(row["signer_chain"])],
                attempt=int(row["deliveries"]) + 1,
                batch_approval=wire.BatchApproval.parse(bytes(row["approval"])) if row["approval"] else None,
                batch_proof=wire.BatchProof.parse(bytes(row["proof"])) if row["proof"] else None,
            )
        )

    def dispatch(self, session: GatewaySession, *, redeliver: bool = False) -> int:
        """Send pending commands within lane credits (and, on a new session, those in flight again).

        Called after every terminal update, so it reads only what it may send: the in-flight count per
        lane, then at most that lane's free credits of pending rows (the index `commands_node`), never
        the whole backlog."""
        if session.closed or self.sessions.get(session.node_id) is not session:
            return 0  # only the session of the node's current epoch is sent commands (DLV-DSP-03)
        now = time.time()
        sent = 0
        with self.store.tx() as c:
            used = {lane: 0 for lane in Lane}
            in_flight = c.execute(
                "SELECT * FROM commands WHERE node_id = ? AND state IN ('dispatched', 'acked', 'running')"
                " ORDER BY seq",
                (session.node_id,),
            ).fetchall()
            for row in in_flight:
                used[Lane(row["lane"])] += 1
                if redeliver:
                    session.out(self._command_message(row))
                    sent += 1
            for lane in Lane:
                free = LANE_CREDITS[lane] - used[lane]
                if free <= 0:
                    continue
                rows = c.execute(
                    "SELECT * FROM commands WHERE node_id = ? AND state = 'pending' AND lane = ?"
                    " AND not_before <= ? AND not_after_ms > ? ORDER BY seq LIMIT ?",
                    (session.node_id, lane.value, now, now * 1000, free + _SKIP_ALLOWANCE),
                ).fetchall()
                for row in rows:
                    if free <= 0:
                        break
                    body = bytes(row["body"])
                    if self._known_bodies.pop(body, None) != session.node_id and not _body_ok(
                        body, session.node_id
                    ):
                        c.execute(
                            "UPDATE commands SET state = 'cancelled', reason = 'invalid-body', updated_at = ?"
                            " WHERE id = ?",
                            (now, row["id"]),
                        )  # never sent (DLV-CMD-17)
                        continue
                    free -= 1
                    c.execute(
                        "UPDATE commands SET state = 'dispatched', dispatched_at = ?, dispatched_epoch = ?,"
                        " deliveries = deliveries + 1, updated_at = ? WHERE id = ?",
                        (now, session.epoch, now, row["id"]),
                    )
                    session.out(self._command_message(row))
                    sent += 1
        return sent

    def sweep(self, now: float | None = None) -> int:
        """The CommandSweeper: expire pending commands past not_after; fail in-flight ones past not_after
        plus their kind's timeout with `timeout`."""
        now = time.time() if now is None else now
        with self.store.tx() as c:
            n = c.execute(
                "UPDATE commands SET state = 'expired', updated_at = ? WHERE state = 'pending' AND"
                " not_after_ms <= ?",
                (now, now * 1000),
            ).rowcount
            n += c.execute(
                "UPDATE commands SET state = 'failed', error_code = 'timeout', updated_at = ?"
                " WHERE state IN ('dispatched', 'acked', 'running') AND not_after_ms + timeout_s * 1000 <= ?",
                (now, now * 1000),
            ).rowcount
        return int(n)

    def command(self, command_id: str) -> dict[str, Any] | None:
        row = self.store.one("SELECT * FROM commands WHERE id = ?", command_id)
        if row is None:
            return None
        doc = {
            k: row[k]
            for k in row.keys()  # noqa: SIM118
            if k not in ("body", "signature", "signer_chain", "approval", "proof")
        }
        for k in ("result", "node_sig", "attestation"):
            doc[k] = bytes(doc[k]).hex() if doc[k] is not None else None
        doc["updates"] = [
            dict(r)
            for r in self.store.all(
                "SELECT state, known, applied, at FROM updates WHERE command_id = ? ORDER BY n", command_id
            )
        ]
        return doc

    # --- sessions -----------------------------------------------------------------------------------

    def node_certificate_ok(self, node_id: str, peer_der: bytes | None) -> str:
        """'' when the TLS peer's certificate is this node's (bcd's own chain check), else why not."""
        if peer_der is None:
            return ""  # the Unix socket: local, trusted by its file mode
        try:
            signer = verify_chain(
                [peer_der],
                Roots.from_ders([self.keys.node_ca_der]),
                Purpose.ATTESTED_REPORT,
                dt.datetime.now(dt.UTC),
            )
        except PkiError as exc:
            return f"client certificate refused: {exc}"
        if signer.name != node_id:
            return f"client certificate names {signer.name!r}, Hello names {node_id!r}"
        return ""

    def open_session(
        self, hello: wire.Hello, send: trio.MemorySendChannel[wire.GatewayMessage]
    ) -> GatewaySession:
        node_id = hello.node_id
        row = self.store.one("SELECT journal_id FROM nodes WHERE node_id = ?", node_id)
        if row is None:
            raise PermissionError(f"node {node_id!r} has not joined")
        epoch = self.store.next_counter("epoch")
        with self.store.tx() as c:
            if row["journal_id"] != hello.journal_id:
                # A new journal cannot deduplicate: fail non-retry-safe in-flight commands (journal-lost),
                # and count its events from 1.
                if row["journal_id"]:
                    c.execute(
                        "UPDATE commands SET state = 'failed', error_code = 'journal-lost', updated_at = ?"
                        " WHERE node_id = ? AND retry_safe = 0 AND state IN ('dispatched', 'acked',"
                        " 'running')",
                        (time.time(), node_id),
                    )
                c.execute(
                    "UPDATE nodes SET journal_id = ?, acked_event_seq = 0 WHERE node_id = ?",
                    (hello.journal_id, node_id),
                )
            c.execute(
                "UPDATE nodes SET boot_id = ?, hellos = hellos + 1, epoch = ?,"
                " applied_generation = ? WHERE node_id = ?",
                (hello.boot_id, epoch, hello.applied_generation, node_id),
            )
        old = self.sessions.get(node_id)
        if old is not None:
            old.closed = True
            old.send.close()
        session = GatewaySession(node_id, epoch, send, applied_generation=hello.applied_generation)
        self.sessions[node_id] = session
        session.out(
            wire.GatewayMessage(
                welcome=wire.Welcome(
                    server_time=int(time.time() * 1000),
                    session_epoch=epoch,
                    trust_bundle=self.keys.signed_trust_bundle(),
                    heartbeat_interval_ms=HEARTBEAT_MS,
                )
            )
        )
        current = self.desired_state(node_id)
        if current is not None and current[0] > hello.applied_generation:
            self.send_spec(session)  # before any command (DLV-RCV-01)
        for update in hello.unacked_results:
            self.on_update(session, update)
        self.dispatch(session, redeliver=True)
        self.send_cancels(session)
        return session

    def close_session(self, session: GatewaySession) -> None:
        session.closed = True
        if self.sessions.get(session.node_id) is session:
            del self.sessions[session.node_id]

    def on_message(self, session: GatewaySession, message: wire.NodeMessage) -> None:
        if message.heartbeat is not None:
            session.applied_generation = max(session.applied_generation, message.heartbeat.applied_generation)
            session.out(wire.GatewayMessage(heartbeat=self._gateway_heartbeat(session.node_id)))
        elif message.status is not None:
            self.on_status(session, message.status)
        elif message.command_update is not None:
            self.on_update(session, message.command_update)
        elif message.event_batch is not None:
            self.on_events(session, message.event_batch)
        elif message.spec_request is not None:
            if not self.send_spec(session):
                log.info("devplane: %s asked for a spec; none is written", session.node_id)
        elif message.secret_request is not None:
            session.out(
                wire.GatewayMessage(secret_response=self.secret(session.node_id, message.secret_request))
            )
        elif message.hello is not None:
            raise ValueError("a second Hello on one session")

    def _gateway_heartbeat(self, node_id: str) -> wire.GatewayHeartbeat:
        row = self.store.one("SELECT generation FROM nodes WHERE node_id = ?", node_id)
        return wire.GatewayHeartbeat(
            server_time=int(time.time() * 1000), generation=int(row[0]) if row else 0
        )

    def on_status(self, session: GatewaySession, report: wire.StatusReport) -> None:
        session.applied_generation = max(session.applied_generation, report.applied_generation)
        with self.store.tx() as c:
            c.execute(
                "UPDATE nodes SET status = ?, status_at = ?, applied_generation = ? WHERE node_id = ?",
                (bytes(report), time.time(), report.applied_generation, session.node_id),
            )
            # Never backwards, whichever session a late report arrives on (DLV-GEN-04).
            c.execute(
                "UPDATE nodes SET observed_generation = ? WHERE node_id = ? AND observed_generation < ?",
                (report.observed_generation, session.node_id, report.observed_generation),
            )

    def on_update(self, session: GatewaySession, update: wire.CommandUpdate) -> None:
        state = _STATE_NAMES.get(update.state, "")
        terminal = state in ("succeeded", "failed", "rejected", "cancelled")
        applied = False
        with self.store.tx() as c:
            row = c.execute(
                "SELECT state FROM commands WHERE id = ? AND node_id = ?",
                (update.command_id, session.node_id),
            ).fetchone()
            known = row is not None
            current = str(row["state"]) if row is not None else ""
            now = time.time()
            if known and current not in TERMINAL:
                if terminal:
                    c.execute(
                        "UPDATE commands SET state = ?, error_code = ?, reason = ?, message = ?, result = ?,"
                        " node_sig = ?, attestation = ?, boot_id = ?, updated_at = ? WHERE id = ?",
                        (
                            state, update.error_code, update.reason, update.message, bytes(update.result),
                            bytes(update.node_sig), bytes(update.attestation), update.boot_id, now,
                            update.command_id,
                        ),
                    )  # fmt: skip
                    applied = True
                elif state == "busy":
                    c.execute(
                        "UPDATE commands SET state = 'pending', not_before = ?, updated_at = ? WHERE id = ?",
                        (now + 1.0, now, update.command_id),
                    )
                    applied = True
                elif state in _ORDER and _ORDER[state] > _ORDER.get(current, 0):
                    c.execute(
                        "UPDATE commands SET state = ?, updated_at = ? WHERE id = ?",
                        (state, now, update.command_id),
                    )
                    applied = True
            log_update_in(c, update.command_id, session.node_id, state or str(update.state), known, applied)
        if terminal:
            # Every terminal update is acknowledged, stored earlier or unknown included (DLV-RES-11).
            session.out(wire.GatewayMessage(ack=wire.Ack(command_ids=[update.command_id])))
            self.poke()

    def on_events(self, session: GatewaySession, batch: wire.EventBatch) -> None:
        with self.store.tx() as c:
            row = c.execute(
                "SELECT journal_id, acked_event_seq FROM nodes WHERE node_id = ?", (session.node_id,)
            ).fetchone()
            if row is None or row["journal_id"] != batch.journal_id:
                return  # another journal's batch (DLV-EVT-08)
            acked = int(row["acked_event_seq"])
            top = acked
            for event in batch.events:
                if event.seq <= acked:
                    continue
                c.execute(
                    "INSERT OR IGNORE INTO events (node_id, journal_id, seq, type, event, received_at)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (session.node_id, batch.journal_id, event.seq, event.type, bytes(event), time.time()),
                )
                top = max(top, event.seq)
            if top > acked:
                c.execute("UPDATE nodes SET acked_event_seq = ? WHERE node_id = ?", (top, session.node_id))
        session.out(wire.GatewayMessage(ack=wire.Ack(journal_id=batch.journal_id, event_seq=top)))

    # --- secrets --------------------------------------------------------------------------------------

    def put_secret(self, ref: str, value: bytes) -> None:
        with self.store.tx() as c:
            c.execute("INSERT OR REPLACE INTO secrets (ref, value) VALUES (?, ?)", (ref, value))

    def secret(self, node_id: str, request: wire.SecretRequest) -> wire.SecretResponse:
        """Released only while the node's current spec names the reference (`_names_secret`)."""
        row = self.store.one("SELECT spec_json FROM nodes WHERE node_id = ?", node_id)
        named = row is not None and bool(row[0]) and _names_secret(json.loads(row[0]), request)
        if not named:
            return wire.SecretResponse(
                request_id=request.request_id,
                status=wire.SecretStatus.REFUSED,
                message=f"{request.ref} is not named by node {node_id}'s current spec",
            )
        value = self.store.one("SELECT value FROM secrets WHERE ref = ?", request.ref)
        if value is None:
            return wire.SecretResponse(
                request_id=request.request_id,
                status=wire.SecretStatus.UNAVAILABLE,
                message="no value stored yet",
            )
        return wire.SecretResponse(
            request_id=request.request_id, status=wire.SecretStatus.OK, value=bytes(value[0])
        )

    # --- reading ------------------------------------------------------------------------------------

    def node(self, node_id: str) -> dict[str, Any] | None:
        row = self.store.one("SELECT * FROM nodes WHERE node_id = ?", node_id)
        if row is None:
            return None
        doc = {
            k: row[k]
            for k in row.keys()  # noqa: SIM118
            if k not in ("public_key", "certificate", "spec_body", "spec_signature", "status")
        }
        doc["status"] = None
        if row["status"] is not None:
            doc["status"] = wire.StatusReport.parse(bytes(row["status"])).to_dict()
        doc["connected"] = node_id in self.sessions
        doc["events"] = [
            {"journal_id": r["journal_id"], "seq": r["seq"], "type": r["type"]}
            for r in self.store.all(
                "SELECT journal_id, seq, type FROM events WHERE node_id = ? ORDER BY received_at, seq",
                node_id,
            )
        ]
        return doc

    def nodes(self) -> list[str]:
        return [str(r[0]) for r in self.store.all("SELECT node_id FROM nodes ORDER BY joined_at")]


_KNOWN_BODIES_MAX = 100_000


def _body_ok(body: bytes, node_id: str) -> bool:
    """A stored command body the gateway may send: it decodes, has `not_after` and names this node."""
    try:
        decoded = wire.CommandBody.parse(body)
    except Exception:  # any decode failure is an invalid body
        return False
    return decoded.not_after > 0 and decoded.node_id == node_id


def _timeout(spec: KindSpec | None) -> float:
    from bcd_agent.dispatch.kinds import timeout_for

    return spec.timeout_s if spec is not None else timeout_for("")


def _check_csr(csr_der: bytes, public_key: bytes) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        csr = x509.load_der_x509_csr(csr_der)
    except ValueError as exc:
        raise PermissionError(f"csr: not a PKCS#10 request: {exc}") from None
    raw = csr.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    if raw != public_key or not csr.is_signature_valid:
        raise PermissionError("csr: not signed by node_public_key")


def payload_for(kind: str, payload_json: Any) -> wire.ProtoAny | None:
    """A command payload from JSON: a registered kind's request message in protobuf's JSON mapping, or a
    test kind's JSON object (bcd_agent.kinds.testing)."""
    if kind.startswith("test."):
        from bcd_agent.kinds.testing import EFFECT_TYPE_URL

        value = json.dumps(payload_json or {}, sort_keys=True).encode()
        return wire.ProtoAny(type_url=EFFECT_TYPE_URL, value=value)
    messages = KIND_MESSAGES.get(kind)
    if messages is None:
        return None
    request = messages.request.from_dict(payload_json or {})
    return wire.ProtoAny(type_url=type_url(messages.request), value=bytes(request))


def ssl_server_context(keys: keysmod.Keys, directory: Path) -> ssl.SSLContext:
    """TLS 1.3 with the gateway's Ed25519 certificate; client certificates requested, optional (the join
    has none yet). OpenSSL does not know bcd's critical role extension, so X509_V_FLAG_IGNORE_CRITICAL is
    set and the session checks the node's chain with bcd's own checker (`node_certificate_ok`)."""
    cert_path = directory / "tls-server.pem"
    if not cert_path.exists():
        from bcd_shared.system import atomic_write

        atomic_write(cert_path, keys.tls_key_pem() + keys.tls_cert_pem, mode=0o600)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(cert_path))
    ctx.load_verify_locations(cadata=keys.ca_pem().decode())
    ctx.verify_mode = ssl.CERT_OPTIONAL
    ctx.verify_flags |= 0x10  # X509_V_FLAG_IGNORE_CRITICAL
    ctx.set_alpn_protocols(["h2"])
    return ctx
