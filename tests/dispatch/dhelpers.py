"""Helpers for the dispatch tests: a real pki hierarchy, commands built through the real wire, a harness
that runs the real Dispatcher over the real journal and quorum ledger."""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing
from bcd_agent.dispatch.command import CommandEnvelope, CommandUpdate, UpdateState
from bcd_agent.dispatch.dispatcher import Dispatcher
from bcd_agent.dispatch.handlers import Handler
from bcd_agent.dispatch.kinds import KINDS, KindSpec, Lane, Role
from bcd_agent.dispatch.quorum import QuorumLedger
from bcd_agent.dispatch.trust import BundleTrust, NodeResultSigner
from bcd_agent.dispatch.wire import envelope_from_wire
from bcd_agent.journal import Journal
from bcd_agent.kinds.testing import TEST_KINDS, effect_payload
from bcd_shared import wire
from bcd_shared.pki import KeyPair, TrustBundle, issue_leaf, issue_root
from bcd_shared.pki import Role as PkiRole
from bcd_shared.pki.bundle import Approver
from bcd_shared.pki.quorum import approve, build_batch

NODE = "node-a"
BOOT = "boot-1"
# Server time at trio time 0 in the harness; the host clock is this plus HOST_SKEW.
T0 = dt.datetime(2026, 11, 20, 12, 0, tzinfo=dt.UTC)
HOST_SKEW_S = -7.0
# The Journal's methods that write, each one durable transaction (wrapped by the tests that count or
# crash at its writes).
JOURNAL_WRITES = (
    "accept_command",
    "accept_commands",
    "mark_running",
    "complete",
    "complete_many",
    "reject",
    "cancel",
    "cancel_new",
    "settle",
)
ALL_KINDS: Mapping[str, KindSpec] = {**KINDS, **TEST_KINDS}
_LANE_WIRE = {Lane.CONTROL: wire.Lane.CONTROL, Lane.PROVISION: wire.Lane.PROVISION, Lane.BULK: wire.Lane.BULK}
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_ids = itertools.count(1)


def _wait_s() -> float:
    """How long a test waits for an update: 30 s of real time, a day of a MockClock's virtual time."""
    return 86400.0 if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock) else 30.0


def ulid() -> str:
    """A fresh, valid ULID-shaped id (monotonic per test process)."""
    n = next(_ids)
    digits = []
    for _ in range(26):
        digits.append(_CROCKFORD[n % 32])
        n //= 32
    return "01" + "".join(reversed(digits))[2:]


@attrs.frozen
class Pki:
    root_key: KeyPair
    root: bytes
    worker_key: KeyPair
    worker_chain: tuple[bytes, ...]
    other_key: KeyPair  # a key that chains nowhere
    other_chain: tuple[bytes, ...]
    approvers: tuple[KeyPair, ...]
    node_key: KeyPair

    @classmethod
    def build(cls) -> Pki:
        day = dt.timedelta(days=1)
        root_key, worker_key = KeyPair.generate(), KeyPair.generate()
        root = issue_root(root_key, "command-signing root", T0 - 365 * day, T0 + 3650 * day)
        leaf = issue_leaf(
            root, root_key, worker_key.public_key, PkiRole.WORKER, "worker-1", T0 - day, T0 + 30 * day
        )
        stray_root_key, other_key = KeyPair.generate(), KeyPair.generate()
        stray_root = issue_root(stray_root_key, "stray root", T0 - 365 * day, T0 + 3650 * day)
        other = issue_leaf(
            stray_root,
            stray_root_key,
            other_key.public_key,
            PkiRole.WORKER,
            "worker-x",
            T0 - day,
            T0 + 30 * day,
        )
        approvers = tuple(KeyPair.generate() for _ in range(3))
        return cls(root_key, root, worker_key, (leaf,), other_key, (other,), approvers, KeyPair.generate())

    def bundle(
        self, *, roots: bool = True, approvers: int = 0, required: int = 2, allowance: int = 0
    ) -> TrustBundle:
        return TrustBundle(
            version=1,
            command_roots=(self.root,) if roots else (),
            approvers=tuple(
                Approver(f"approver-{i}", k.public_key) for i, k in enumerate(self.approvers[:approvers])
            ),
            approvals_required=required if approvers else 0,
            unbatched_destructive_per_hour=allowance,
        )


def make_command(
    pki: Pki | None = None,
    *,
    id: str | None = None,
    node_id: str = NODE,
    seq: int = 1,
    kind: str = "test.effect",
    lane: Lane | None = None,
    payload: tuple[str, bytes] | None = None,
    not_after: dt.datetime | str | None = "default",
    min_generation: int = 0,
    retry_safe: bool | None = None,
    self_terminating: bool | None = None,
    attested: bool | None = None,
    batch_id: str = "",
    target_node_id: str = "",
    traceparent: str = "",
    sign: str = "worker",  # worker | other | none | tamper
    batch: tuple[wire.BatchApproval, wire.BatchProof] | None = None,
    kinds: Mapping[str, KindSpec] = ALL_KINDS,
) -> CommandEnvelope:
    """A command as the control plane would send it, converted through the real wire edge."""
    spec = kinds.get(kind)
    type_url, value = payload if payload is not None else effect_payload("t")
    if not_after == "default":
        not_after = T0 + dt.timedelta(minutes=10)
    body = wire.CommandBody(
        id=id or ulid(),
        node_id=node_id,
        seq=seq,
        kind=kind,
        payload=wire.ProtoAny(type_url=type_url, value=value),
        lane=_LANE_WIRE[lane or (spec.lane if spec else Lane.CONTROL)],
        not_after=0 if not_after is None else int(not_after.timestamp() * 1000),  # type: ignore[union-attr]
        min_generation=min_generation,
        retry_safe=spec.retry_safe if retry_safe is None and spec else bool(retry_safe),
        self_terminating=spec.self_terminating
        if self_terminating is None and spec
        else bool(self_terminating),
        attested=spec.attested if attested is None and spec else bool(attested),
        batch_id=batch_id,
        target_node_id=target_node_id,
        traceparent=traceparent,
    )
    raw = bytes(body)
    signature, chain = b"", ()
    if pki is not None and sign != "none":
        key, chain = (
            (pki.other_key, pki.other_chain) if sign == "other" else (pki.worker_key, pki.worker_chain)
        )
        from bcd_shared.pki.signing import Purpose

        signature = key.sign(Purpose.COMMAND, raw)
        if sign == "tamper":
            raw = raw[:-1] + bytes([raw[-1] ^ 0x01]) if raw[-1:] != b"" else raw
    msg = wire.Command(body=raw, signature=signature, signer_chain=list(chain), attempt=1)
    if batch is not None:
        msg.batch_approval, msg.batch_proof = batch
    return envelope_from_wire(msg)


def leaf_for(cmd_id: str, kind: str, subject: str = NODE, payload: bytes | None = None) -> wire.BatchLeaf:
    value = payload if payload is not None else effect_payload("t")[1]
    return wire.BatchLeaf(
        subject=subject, kind=kind, payload_sha256=hashlib.sha256(value).digest(), command_id=cmd_id
    )


def approved_batch(
    pki: Pki, batch_id: str, leaves: list[wire.BatchLeaf], index: int, signers: tuple[int, ...] = (0, 1)
) -> tuple[wire.BatchApproval, wire.BatchProof]:
    """An approval by `signers` (approver indexes; repeat one to test distinct-key counting) and the proof
    of leaf `index`."""
    batch = build_batch(batch_id, leaves, "test batch")
    sigs = [approve(pki.approvers[i], f"approver-{i}", batch.scope) for i in signers]
    return wire.BatchApproval(scope=batch.scope, signatures=sigs), batch.proof(index)


class EffectCtx:
    """What a kind's handler runs with outside the dispatcher: this boot, never cancelled; `began` counts
    its begin_effect calls."""

    boot_id = BOOT
    cancel_requested = False

    def __init__(self) -> None:
        self.began = 0

    async def begin_effect(self) -> None:
        self.began += 1


class TrioClock:
    """Server time = T0 + trio time since creation + offset; host time = server time + HOST_SKEW_S +
    host_jump. Created inside trio (the harness is built in the test)."""

    def __init__(self) -> None:
        self._start = trio.current_time()
        self.offset_s = 0.0
        self.host_jump_s = 0.0

    def server_now(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=trio.current_time() - self._start + self.offset_s)

    def host_time(self) -> float:
        return self.server_now().timestamp() + HOST_SKEW_S + self.host_jump_s


class Sink:
    """Records every update; `by_id` and `states` answer what a command was told."""

    def __init__(self) -> None:
        self.updates: list[CommandUpdate] = []
        self.event = trio.Event()

    def send(self, update: CommandUpdate) -> None:
        self.updates.append(update)
        self.event.set()
        self.event = trio.Event()

    def of(self, command_id: str) -> list[CommandUpdate]:
        return [u for u in self.updates if u.command_id == command_id]

    def states(self, command_id: str) -> list[UpdateState]:
        return [u.state for u in self.of(command_id)]

    def terminal(self, command_id: str) -> CommandUpdate | None:
        done = [u for u in self.of(command_id) if u.terminal]
        assert len(done) <= 1 or all(d == done[0] for d in done), done
        return done[0] if done else None

    async def wait_terminal(self, command_id: str) -> CommandUpdate:
        with trio.fail_after(_wait_s()):
            while (t := self.terminal(command_id)) is None:
                await self.event.wait()
        return t

    async def wait_state(self, command_id: str, state: UpdateState) -> None:
        with trio.fail_after(_wait_s()):
            while state not in self.states(command_id):
                await self.event.wait()


class SpecRequests:
    def __init__(self) -> None:
        self.sent: list[int] = []

    def request_spec_for_min_generation(self, have_generation: int) -> None:
        self.sent.append(have_generation)


class Harness:
    """One agent's dispatcher state in a data_dir; `restart()` reopens it as a new process would."""

    def __init__(
        self,
        data_dir: Path,
        pki: Pki,
        *,
        bundle: TrustBundle | None = None,
        role: Role = Role.NODE,
        boot_id: str = BOOT,
        journal_options: dict[str, Any] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.pki = pki
        self.role = role
        self.trust = BundleTrust(bundle)
        self.sink = Sink()
        self.specs = SpecRequests()
        self.clock = TrioClock()
        self.boot_id = boot_id
        self.journal_options = journal_options or {}
        self.journal = Journal.open(data_dir, boot_id=boot_id, **self.journal_options)
        self.ledger = QuorumLedger.open(data_dir)

    def reopen(self, boot_id: str | None = None) -> None:
        """A new process: close the journal, open it (new incarnation) and reload the ledger from disk."""
        self.journal.close()
        self.sink = Sink()
        self.specs = SpecRequests()
        self.boot_id = boot_id or self.boot_id
        self.journal = Journal.open(self.data_dir, boot_id=self.boot_id, **self.journal_options)
        self.ledger = QuorumLedger.open(self.data_dir)

    def dispatcher(
        self,
        handlers: Mapping[str, Handler],
        *,
        kinds: Mapping[str, KindSpec] = ALL_KINDS,
        applied_generation: int = 0,
        **kwargs: Any,
    ) -> Dispatcher:
        return Dispatcher(
            node_id=NODE,
            role=self.role,
            journal=self.journal,
            sink=self.sink,
            spec_requester=self.specs,
            trust=self.trust,
            batches=self.trust,
            ledger=self.ledger,
            clock=self.clock,
            handlers=handlers,
            signer=NodeResultSigner(self.pki.node_key, NODE),
            kinds=kinds,
            applied_generation=applied_generation,
            **kwargs,
        )


class Gate:
    """A hook that blocks until released, counting how many run at once."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.active = 0
        self.max_active = 0
        self.entered: list[str] = []

    async def __call__(self, cmd: CommandEnvelope) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.entered.append(cmd.id)
        try:
            await self.release.wait()
        finally:
            self.active -= 1


async def start(nursery: trio.Nursery, d: Dispatcher) -> Dispatcher:
    started: Dispatcher = await nursery.start(d.run)
    return started


def effect_lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def effect_ids(log: Path) -> Iterator[str]:
    return (line.split()[0] for line in effect_lines(log))
