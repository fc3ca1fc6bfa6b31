"""What every op shares (bcd_helper.ops.base), called in process: refusals and failures as the server
reads them, the call's deadline to its edge, the bounded System's cap on every program and its refusal to
start one once the deadline has passed, the context's per-op locks and lazily made verifier, and when a
request can skip the signed-intent checks (docs/mutation.md)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from bcd_helper.ops import base
from bcd_helper.ops.base import (
    INTENT_STATE_PATH,
    JOIN_RECORD_PATH,
    BoundedSystem,
    Deadline,
    Failed,
    Refused,
    no_roots_possible,
    refused_path,
)
from bcd_helper.ops.table import LOCK_ORDER
from bcd_shared.rootpath import RootPathRefused
from bcd_shared.system import DEFAULT_TOOL_TIMEOUT_S, CommandResult, LocalSystem
from intentkit import ControlPlane
from opskit import NODE_UID, Programs, context, make_root

HELPER = f'[helper]\nsocket = "/run/bcd/helper.sock"\nnode_uid = {NODE_UID}\n'


class Recorder(LocalSystem):
    """Records each program with the timeout and input it was given."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.runs: list[tuple[tuple[str, ...], float, bytes | None]] = []

    def run(
        self, argv: Sequence[str], *, timeout: float = DEFAULT_TOOL_TIMEOUT_S, input: bytes | None = None
    ) -> CommandResult:
        self.runs.append((tuple(argv), timeout, input))
        return CommandResult(tuple(argv), 0, b"out", b"")


class FdRecorder(LocalSystem):
    """Records each program with its timeout, input and the descriptors handed to it (`pass_fds`)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.runs: list[tuple[tuple[str, ...], float, bytes | None, tuple[int, ...]]] = []

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
        pass_fds: Sequence[int] = (),
    ) -> CommandResult:
        self.runs.append((tuple(argv), timeout, input, tuple(pass_fds)))
        return CommandResult(tuple(argv), 0, b"out", b"")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock(1000.0)
    monkeypatch.setattr(base.time, "monotonic", c)
    return c


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_root(tmp_path)


def test_refused_and_failed_carry_reason_and_message() -> None:
    r = Refused("bad-kind", "file.write: kind 'x' is not one of ...")
    f = Failed("nft", "nft -f: nft exited 1")
    assert (r.reason, r.message, str(r), r.args) == (
        "bad-kind",
        "file.write: kind 'x' is not one of ...",
        "file.write: kind 'x' is not one of ...",
        ("file.write: kind 'x' is not one of ...",),
    )
    assert (f.reason, f.message, str(f), f.args) == (
        "nft",
        "nft -f: nft exited 1",
        "nft -f: nft exited 1",
        ("nft -f: nft exited 1",),
    )


def test_a_root_only_refusal_becomes_refused_root_only() -> None:
    exc = RootPathRefused("/etc/ssh/bcd", "/etc/ssh/bcd is a symlink")
    got = refused_path(exc)
    assert (type(got), got.reason, got.message) == (Refused, "root-only", "/etc/ssh/bcd is a symlink")


def test_the_deadline_counts_down_and_expires_at_zero(clock: Clock) -> None:
    d = Deadline(30)
    assert (d.seconds, d.remaining(), d.expired()) == (30, 30.0, False)
    clock.now += 29.5
    assert (d.remaining(), d.expired()) == (0.5, False)
    clock.now += 0.5
    assert (d.remaining(), d.expired()) == (0.0, True)  # nothing left is expired
    clock.now += 1
    assert (d.remaining(), d.expired()) == (-1.0, True)


def test_each_program_gets_the_least_of_its_timeout_the_cap_and_what_is_left(
    root: Path, clock: Clock
) -> None:
    inner = Recorder(root)
    d = Deadline(100)
    system = BoundedSystem(inner, d, tool_cap=50)
    assert system.run(["a"], timeout=10, input=b"in").stdout == b"out"  # its own timeout
    system.run(["b"], timeout=80)  # the cap
    clock.now += 70
    system.run(["c"], timeout=40)  # what is left
    system.run(["d"])  # the default timeout, capped
    clock.now += 29.5
    system.run(["f"], timeout=5)  # under a second left: still started, with what is left
    assert inner.runs == [
        (("a",), 10, b"in"),
        (("b",), 50, None),
        (("c",), 30.0, None),
        (("d",), 30.0, None),
        (("f",), 0.5, None),
    ]
    # Without a cap given, the cap is the default tool timeout (20 minutes).
    long = BoundedSystem(inner, Deadline(7200))
    long.run(["e"], timeout=3600)
    assert inner.runs[-1] == (("e",), DEFAULT_TOOL_TIMEOUT_S, None)
    assert DEFAULT_TOOL_TIMEOUT_S == 1200


def test_a_program_handed_descriptors_gets_them_and_the_same_bounds(root: Path, clock: Clock) -> None:
    inner = FdRecorder(root)
    system = BoundedSystem(inner, Deadline(100), tool_cap=50)
    assert system.run(["a"], timeout=10, input=b"in", pass_fds=(7,)).stdout == b"out"  # its own timeout
    system.run(["b"], timeout=80, pass_fds=(8, 9))  # the cap
    clock.now += 70
    system.run(["c"], timeout=40, pass_fds=(10,))  # what is left
    system.run(["d"])  # no descriptors: the two-argument form
    assert inner.runs == [
        (("a",), 10, b"in", (7,)),
        (("b",), 50, None, (8, 9)),
        (("c",), 30.0, None, (10,)),
        (("d",), 30.0, None, ()),
    ]


def test_no_program_starts_once_the_deadline_has_passed(root: Path, clock: Clock) -> None:
    inner = Recorder(root)
    system = BoundedSystem(inner, Deadline(2.6))
    clock.now += 2.6
    with pytest.raises(Failed) as info:
        system.run(["nvidia-smi", "-q"], timeout=5)
    assert (info.value.reason, info.value.message) == (
        "timeout",
        "the operation's 3s ran out before nvidia-smi",
    )
    assert inner.runs == []


def test_the_bounded_system_reads_under_the_root_only_rule(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "etc/x.conf").write_bytes(b"hello\n")
    system = BoundedSystem(LocalSystem(root), Deadline(5))
    assert system.read_root_only("/etc/x.conf") == b"hello\n"
    assert system.read_root_only("/etc/missing") is None
    (root / "etc/link").symlink_to("x.conf")
    with pytest.raises(RootPathRefused):
        system.read_root_only("/etc/link")


def test_the_context_has_one_lock_per_name_and_nothing_else_yet(root: Path) -> None:
    ctx = context(root)
    assert list(ctx.locks) == list(LOCK_ORDER)
    locks = list(ctx.locks.values())
    assert all(type(x) is type(threading.Lock()) for x in locks) and len({id(x) for x in locks}) == len(locks)
    assert (ctx.daemon_timer, ctx.nft_reference, ctx.nft_memo) == (None, None, None)
    assert ctx.nft_loaded == frozenset()
    assert type(ctx.timer_lock) is type(threading.Lock())
    assert ctx.root == root and ctx.config.node_uid == NODE_UID and isinstance(ctx.system, Programs)
    ctx.audit.close()


def test_the_verifier_is_made_once_on_first_use(root: Path) -> None:
    ctx = context(root)
    assert ctx._intent is None  # a start imports no pki
    verifier = ctx.intent_verifier()
    assert ctx.intent_verifier() is verifier
    assert verifier.load_state("x").generation == 0  # over this context's root
    ctx.audit.close()
    # ... and its config: pinned roots want a chain.
    pinned = context(root, ControlPlane.build().config_lines(pin_roots=True).split("\n", 1)[1] + HELPER)
    with pytest.raises(Refused) as info:
        pinned.intent_verifier().trust("host.unit", None, ())
    assert (info.value.reason, info.value.message) == (
        "intent-required",
        "host.unit: command_root_sha256 pins the roots: a signed spec is required",
    )
    pinned.audit.close()


def test_no_roots_possible_only_when_nothing_can_name_roots(root: Path) -> None:
    cp = ControlPlane.build()
    plain = context(root)
    assert no_roots_possible(plain, None) is True
    assert no_roots_possible(plain, b"bundle") is False
    pinned = context(root, cp.config_lines() + HELPER)
    assert no_roots_possible(pinned, None) is False
    roots = context(root, cp.config_lines(pin_roots=True).split("\n", 1)[1] + HELPER)
    assert roots.config.join_signing_key_pin is None and roots.config.command_root_sha256
    assert no_roots_possible(roots, None) is False
    for path in (JOIN_RECORD_PATH, INTENT_STATE_PATH):
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to("/nonexistent")  # even a dangling link: something is there
        assert no_roots_possible(plain, None) is False, path
        target.unlink()
        assert no_roots_possible(plain, None) is True
    for c in (plain, pinned, roots):
        c.audit.close()
