"""`bcd sim`: the development control plane, the agent (and, as root, the helper) on a simulated host.

    bcd sim [--spec FILE] [--root DIR] [--once] [--json] [--timeout S]

One command: it seeds DIR as a simulated GPU host (bcd_simhost.seed: 8 H200s, MIG on GPU 7, 2
NUMA nodes, meminfo, huge page pools; fake nvidia-smi, systemctl, modprobe, ... through sim_system),
starts the development control plane, joins a node to it, starts `bcd node` on the simulated host,
applies FILE (a NodeSpec in protobuf's JSON mapping) and shows the node converge: a compact live view
on a terminal, plain lines otherwise (DIR defaults to .demo/root). Without `--once` it keeps running
(apply another spec with `bcd devplane apply SPEC.json --dir DIR/var/lib/bcd-sim/devplane`) until
Ctrl-C; with `--once` it ends once the node's status has settled (or at `--timeout`), prints the final
status, and exits 0 when converged, 1 otherwise. "Settled" (`Settler`): the control plane sees the
spec's generation applied and observed, AND for SETTLE_S seconds nothing changed: neither the report
the control plane stored (sections, generations, conditions without their ages), nor the events it
stored, nor the node's own status version (data_dir/status.json, written after every pass). A pass
that changed the host is followed at once by another (the runner's follow-up), whose report may say
something else (a hold on a MIG instance a host unit just made fails in the first pass and binds in
the follow-up): the final status is the one after those passes, never the first report that reached
the generation. `--json` prints ONE JSON object instead:

    {"generation", "applied_generation", "observed_generation",
     "sections": [{"section", "state", "generation", "reason", "message"}, ...],
     "conditions": [{"type", "reason", "message", "age_ms"}, ...],
     "events": [{"seq", "type"}, ...],          # the node's journaled events, in order
     "converged": bool, "timed_out": bool, "root": DIR, "node_id": str}

"Converged": the control plane's observed_generation reached the spec's generation and every section
is CONVERGED. A FAILED section (an assignment that must fail) or an UNSUPPORTED one settles the
generation (observed advances, DLV-CONV-01/04) but is not "converged": exit 1, and the section's
reason and message say why.

Processes (docs/sim.md): the control plane is a trio service in this process (its state, keys and
admin socket in DIR/var/lib/bcd-sim/devplane, so `bcd devplane ...` works beside it); the node is a
child process, `python -m bcd_agent.cli node --config DIR/etc/bcd/node.toml --root DIR`, joined first
with `bcd join`; the helper, when this runs as root and `--helper` is not `no`, is a child process
`bcd helper serve --root DIR` with root's config in DIR/etc/bcd/config.toml. Every child is started
with PR_SET_PDEATHSIG (SIGKILL), forked by the trio thread itself (ChildProcess), and in a trio
nursery: on exit, on an error and on Ctrl-C each gets SIGTERM, then SIGKILL after 5 s, and is waited for.
Their output goes to DIR/var/log/bcd-sim/*.log.

The simulated host stays in DIR afterwards: the CDI specs, env files, slices and records bcd wrote.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, TypeVar

import trio
from attrs import field, frozen
from bcd_shared import wire

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_ROOT = ".demo/root"  # `make demo`'s, and in .gitignore
# How long the node's status must stay the same, once the generation is observed, before `--once`
# reports it: twice the node's status interval (a report that moves no generation waits up to 1 s,
# NodeOptions.status_interval_s), so a follow-up pass's report has arrived.
SETTLE_S = 2.0
SECTION_NAMES = {1: "host", 2: "devices", 3: "instances", 4: "access", 5: "telemetry", 6: "daemon", 7: "site"}
STATE_NAMES = {1: "CONVERGED", 2: "PROGRESSING", 3: "FAILED", 4: "UNSUPPORTED"}
INSTANCE_STATES = {1: "RUNNING", 2: "PAUSED", 3: "STOPPED", 4: "ERROR", 5: "PENDING"}
NODE_UID = 65534  # the node's account when the sim runs as root beside the helper (nobody)


class SimError(Exception):
    """The simulation could not run (a child died, a join failed): the message says which and why."""


class Stopped(Exception):
    """SIGINT or SIGTERM stopped the simulation (every child was stopped first). `starting`: it came
    before the sim took its signals over (`bcd`'s EarlyStop kept it), so no child was started."""

    def __init__(self, signum: int, *, starting: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.starting = starting

    def message(self) -> str:
        if self.starting:
            return f"bcd sim: stopped by {self}, while starting (no process was started)"
        return "bcd sim: stopped"


def _stop_if_signalled(early: Any) -> None:
    """Stopped, when `bcd`'s EarlyStop (bcd_agent.earlystop; None in process) kept a signal."""
    if early is not None and early.received:
        raise Stopped(early.received[0], starting=True)


async def _stop_on_signal(signals: Any, scope: trio.CancelScope, stopped: list[int]) -> None:
    async for signum in signals:
        stopped.append(signum)
        scope.cancel()
        return


# --- layout -----------------------------------------------------------------------------------------------


@frozen
class Layout:
    """Where everything lives under the simulated host DIR (all real paths)."""

    root: Path

    @property
    def state_dir(self) -> Path:  # the simulated host's own state (simhost keeps its fakes' state here)
        return self.root / "var/lib/bcd-sim"

    @property
    def plane_dir(self) -> Path:
        return self.state_dir / "devplane"

    @property
    def gateway_socket(self) -> Path:
        return self.root / "run/bcd-sim/gateway.sock"

    @property
    def data_dir(self) -> Path:
        return self.root / "var/lib/bcd"

    @property
    def node_config(self) -> Path:
        return self.root / "etc/bcd/node.toml"

    @property
    def root_config(self) -> Path:  # root's config.toml for the helper (host paths)
        return self.root / "etc/bcd/config.toml"

    @property
    def helper_socket_host_path(self) -> str:
        return "/run/bcd/helper.sock"

    @property
    def log_dir(self) -> Path:
        return self.root / "var/log/bcd-sim"


# In DIR, written before anything else is seeded there: this directory is a simulated host bcd sim made,
# so a later run may seed into it again and --fresh may remove it.
SIM_MARKER = ".bcd-sim-root"
# The top-level entries a seeded simulated host has: a DIR holding only some of them (say, an audit log
# `bcd helper audit --root DIR init` made before the first run) is still taken.
SIM_TOP = frozenset({"dev", "etc", "lib", "proc", "run", "sys", "tmp", "usr", "var", SIM_MARKER})


def check_sim_root(root: Path) -> None:
    """Refuse (SimError) a DIR that `bcd sim` must not seed fake files into nor remove with --fresh: the
    host's own `/`, a file, or a directory with content that is not a simulated host (`--root /etc`,
    `--root ~`). A new or empty directory, one a run made (the marker, or `var/lib/bcd-sim` of a run
    before the marker existed), or one with nothing but a simulated host's top-level names, is fine."""
    resolved = root.resolve()
    if resolved == Path("/"):
        raise SimError(f"--root {root}: the simulated host cannot be this host's / (name a directory)")
    if not resolved.exists():
        return
    if not resolved.is_dir():
        raise SimError(f"--root {root}: {resolved} is not a directory")
    if (resolved / SIM_MARKER).exists() or (resolved / "var/lib/bcd-sim").is_dir():
        return
    if any(entry.name not in SIM_TOP for entry in resolved.iterdir()):
        raise SimError(
            f"--root {root}: {resolved} is not empty and is not a simulated host (no {SIM_MARKER}): "
            "bcd sim seeds fake host files into DIR and --fresh removes it; name a new or empty directory"
        )


def prepare(layout: Layout, *, helper: bool, node_uid: int | None) -> None:
    """Seed the simulated host and write the node's (and root's) config. Idempotent."""
    from bcd_simhost.seed import seed

    layout.root.mkdir(parents=True, exist_ok=True)
    (layout.root / SIM_MARKER).touch()  # first: an interrupted seed still leaves a DIR a rerun accepts
    seed(layout.root)
    for d in (layout.gateway_socket.parent, layout.log_dir, layout.node_config.parent):
        d.mkdir(parents=True, exist_ok=True)
    lines = [
        "# bcd sim: the node's config (real paths; the node runs with --root for the host's files)",
        f'data_dir = "{layout.data_dir}"',
        "",
        "[control_plane]",
        f'unix_socket = "{layout.gateway_socket}"',
    ]
    if helper:
        lines += ["", "[helper]", f'socket = "{layout.helper_socket_host_path}"']
    layout.node_config.write_text("\n".join(lines) + "\n")
    os.chmod(layout.node_config, 0o644)
    if helper and node_uid is not None:
        layout.data_dir.mkdir(parents=True, exist_ok=True)
        os.chown(layout.data_dir, node_uid, node_uid)
        os.chmod(layout.data_dir, 0o700)
        os.chown(layout.gateway_socket.parent, node_uid, node_uid)


# --- children ---------------------------------------------------------------------------------------------


def _die_with_parent(parent: int) -> Callable[[], None]:
    """The preexec_fn of every child: PR_SET_PDEATHSIG (SIGKILL), then exit at once if `parent` is
    already gone (the signal is only armed for a death that happens after the prctl)."""

    def arm() -> None:  # runs in the child between fork and exec
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return arm


class ChildProcess:
    """A child forked by the thread that runs trio, never by a worker thread.

    PR_SET_PDEATHSIG fires when the THREAD that forked the child exits, not the process:
    trio.lowlevel.open_process forks in a trio worker thread, which exits after ~10 s idle
    (trio's thread cache), and every child then died with SIGKILL. The trio thread lives as long as
    `bcd sim`, so the children die with it and only with it. The fork itself blocks for a moment;
    the wait is on a pidfd, so the loop never blocks on it.
    """

    def __init__(self, argv: Sequence[str], *, user: int | None, **popen: Any) -> None:
        self._popen = subprocess.Popen(
            list(argv),
            preexec_fn=_die_with_parent(os.getpid()),
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            **popen,
        )
        self._pidfd: int | None = os.pidfd_open(self._popen.pid)

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        # The pidfd is closed only once the child is reaped: a cancelled wait leaves it for the next
        # wait (supervise's SIGTERM-then-wait), which must never block the loop in Popen.wait.
        if self._popen.poll() is None and self._pidfd is not None:
            await trio.lowlevel.wait_readable(self._pidfd)
        code = self._popen.wait()  # it has exited: this only reaps it
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            os.close(fd)
        return code

    def terminate(self) -> None:
        self._popen.terminate()

    def kill(self) -> None:
        self._popen.kill()


def bcd_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "bcd_agent.cli", *args]


@frozen
class Child:
    name: str
    argv: tuple[str, ...]
    log: Path
    user: int | None = None
    env: Mapping[str, str] = field(factory=dict)


class Reapable(Protocol):
    """What `watch` needs of a child: ChildProcess or trio.Process."""

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


P = TypeVar("P", bound=Reapable)


async def watch(proc: P, grace_s: float, task_status: trio.TaskStatus[P]) -> None:
    """Hand `proc` to `task_status` and wait for it to exit; if the caller is cancelled first, SIGTERM,
    then SIGKILL after `grace_s`, reaped either way (shielded: a cancelled caller leaves no zombie)."""
    try:
        task_status.started(proc)
        await proc.wait()
    finally:
        if proc.returncode is None:
            with trio.CancelScope(shield=True):
                proc.terminate()
                with trio.move_on_after(grace_s):
                    await proc.wait()
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def supervise(
    child: Child, *, task_status: trio.TaskStatus[ChildProcess] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run `child` until cancelled (SIGTERM, then SIGKILL after 5 s); it exiting on its own is an error."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.env}
    with child.log.open("ab") as log:
        proc = ChildProcess(
            child.argv, user=child.user, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
        )
        await watch(proc, 5, task_status)
    raise SimError(f"{child.name} exited with status {proc.returncode}: {tail(child.log)}")


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


async def run_once(argv: Sequence[str], log: Path, *, user: int | None = None, limit_s: float = 30) -> str:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = ChildProcess(argv, user=user, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        try:
            with trio.fail_after(limit_s):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    with log.open("ab") as f:
        f.write(stdout + stderr)
    if code != 0:
        raise SimError(f"{' '.join(argv[2:])} failed ({code}): {stderr.decode(errors='replace')}")
    return str(stdout.decode(errors="replace"))


async def wait_for_socket(path: Path, proc: ChildProcess, what: str, limit_s: float = 20) -> None:
    with trio.move_on_after(limit_s):
        while not await trio.Path(path).exists():  # another process creates it: poll
            if proc.returncode is not None:
                raise SimError(f"{what} exited with status {proc.returncode} before listening on {path}")
            await trio.sleep(0.02)
        return
    raise SimError(f"{what} did not listen on {path} within {limit_s:g} s")


# --- the view ---------------------------------------------------------------------------------------------


@frozen
class SimView:
    """What the control plane sees of the node (its last StatusReport, events), at one moment."""

    node_id: str
    generation: int
    applied_generation: int
    observed_generation: int
    sections: tuple[dict[str, Any], ...]
    conditions: tuple[dict[str, Any], ...]
    events: tuple[dict[str, Any], ...]
    connected: bool
    # StatusReport.instances: {"instance_id", "runtime", "state", "managed", "message"}
    instances: tuple[dict[str, Any], ...] = ()

    @property
    def settled(self) -> bool:
        return self.generation > 0 and self.observed_generation >= self.generation

    @property
    def converged(self) -> bool:
        current = [s for s in self.sections if s["generation"] >= self.generation]
        return (
            self.settled
            and len(current) == len(self.sections) > 0
            and all(s["state"] == "CONVERGED" for s in self.sections)
        )

    def signature(self) -> tuple[object, ...]:
        """What `--once` waits to stay the same: everything but the conditions' ages."""
        return (
            self.applied_generation,
            self.observed_generation,
            tuple(tuple(sorted(s.items())) for s in self.sections),
            tuple((c["type"], c["reason"], c["message"]) for c in self.conditions),
            tuple((e["seq"], e["type"]) for e in self.events),
            tuple(tuple(sorted(i.items())) for i in self.instances),
        )

    def to_json(self, **more: object) -> dict[str, object]:
        return {
            "node_id": self.node_id,
            "generation": self.generation,
            "applied_generation": self.applied_generation,
            "observed_generation": self.observed_generation,
            "sections": list(self.sections),
            "conditions": list(self.conditions),
            "events": list(self.events),
            "instances": list(self.instances),
            "converged": self.converged,
            **more,
        }


def view_from_report(
    node_id: str,
    generation: int,
    observed: int,
    report: wire.StatusReport | None,
    events: Sequence[Mapping[str, Any]],
    connected: bool,
) -> SimView:
    sections: list[dict[str, Any]] = []
    conditions: list[dict[str, Any]] = []
    instances: list[dict[str, Any]] = []
    applied = 0
    if report is not None:
        instances = [
            {
                "instance_id": i.instance_id,
                "runtime": i.runtime,
                "state": INSTANCE_STATES.get(int(i.state), str(int(i.state))),
                "managed": bool(i.managed),
                "message": i.message,
            }
            for i in report.instances
        ]
        applied = int(report.applied_generation)
        for s in report.sections:
            number = int(s.section)
            sections.append(
                {
                    "section": SECTION_NAMES.get(number, str(number)),
                    "state": STATE_NAMES.get(int(s.state), str(int(s.state))),
                    "generation": int(s.generation),
                    "reason": s.reason,
                    "message": s.message,
                }
            )
        conditions = [
            {"type": c.type, "reason": c.reason, "message": c.message, "age_ms": int(c.age_ms)}
            for c in report.conditions
        ]
    return SimView(
        node_id=node_id,
        generation=generation,
        applied_generation=applied,
        observed_generation=observed,
        sections=tuple(sections),
        conditions=tuple(conditions),
        events=tuple({"seq": int(e["seq"]), "type": str(e["type"])} for e in events),
        connected=connected,
        instances=tuple(instances),
    )


def plane_view(plane: Any, node_id: str) -> SimView:
    """The control plane's record of the node (devplane's store: generation, observed, last report)."""
    row = plane.store.one(
        "SELECT generation, observed_generation, status FROM nodes WHERE node_id = ?", node_id
    )
    if row is None:
        raise SimError(f"node {node_id} is not known to the control plane")
    report = wire.StatusReport.parse(bytes(row["status"])) if row["status"] is not None else None
    events = plane.store.all(
        "SELECT seq, type FROM events WHERE node_id = ? ORDER BY journal_id, seq", node_id
    )
    return view_from_report(
        node_id,
        int(row["generation"]),
        int(row["observed_generation"]),
        report,
        [{"seq": e["seq"], "type": e["type"]} for e in events],
        node_id in plane.sessions,
    )


def forget_status(plane: Any, node_id: str) -> None:
    """Drop the report the control plane stored for `node_id` (an earlier run's); observed_generation
    stays, the next report this run's node sends replaces it."""
    with plane.store.tx() as c:
        c.execute("UPDATE nodes SET status = NULL WHERE node_id = ?", (node_id,))


def node_status_version(data_dir: Path) -> tuple[int, int] | None:
    """(pid, status version) of the node's data_dir/status.json, which the node writes after every
    pass; None while there is none (or it cannot be read)."""
    from bcd_agent.statusfile import StatusFileError, read_status

    try:
        status = read_status(data_dir)
    except (OSError, StatusFileError):
        return None
    return None if status is None else (status.pid, status.status_version)


class Settler:
    """When `--once` may stop (pure: the caller gives the time). `update` takes each new look at the
    node and says whether its status has settled: the generation applied and observed, and nothing
    of it changed for `settle_s` (the module docstring says why)."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self._last: tuple[object, ...] | None = None
        self._since: float | None = None

    def update(self, view: SimView, node_version: object, now: float, *, current: bool = True) -> bool:
        """`current`: the node's status file is this run's node's (never settle on an earlier run's)."""
        if not (current and view.settled and view.applied_generation >= view.generation):
            self._last, self._since = None, None
            return False
        key = (view.signature(), node_version)
        if key != self._last or self._since is None:
            self._last, self._since = key, now
        return now - self._since >= self.settle_s


def render(view: SimView, *, elapsed_s: float, spec: str) -> str:
    verdict = "converged" if view.converged else "settled" if view.settled else "converging"
    lines = [
        f"bcd sim  {spec}  node {view.node_id}  {'connected' if view.connected else 'DISCONNECTED'}"
        f"  {elapsed_s:5.1f}s",
        f"generation {view.generation}: applied {view.applied_generation},"
        f" observed {view.observed_generation}  ({verdict})",
        "",
    ]
    for s in view.sections:
        why = ": ".join(x for x in (s["reason"], s["message"]) if x)
        lines.append(f"  {s['section']:<10} {s['state']:<12} gen {s['generation']:<3} {why}"[:160])
    for c in view.conditions:
        lines.append(f"  condition {c['type']} {c['reason']}: {c['message']}"[:160])
    for i in view.instances:
        how = f"{i['runtime']}{'' if i['managed'] else ', unmanaged'}"
        lines.append(f"  instance {i['instance_id']:<16} {i['state']:<8} ({how}) {i['message']}"[:160])
    if view.events:
        shown = ", ".join(f"{e['seq']} {e['type']}" for e in view.events[-6:])
        lines.append(f"  events: {shown}")
    return "\n".join(lines) + "\n"


def change_lines(previous: SimView | None, view: SimView) -> list[str]:
    """Plain lines for what changed since `previous` (the non-TTY live view)."""
    out: list[str] = []
    if previous is None or (previous.applied_generation, previous.observed_generation) != (
        view.applied_generation,
        view.observed_generation,
    ):
        out.append(
            f"generation {view.generation}: applied {view.applied_generation},"
            f" observed {view.observed_generation}"
        )
    before = {s["section"]: s for s in previous.sections} if previous else {}
    for s in view.sections:
        if before.get(s["section"]) != s:
            why = ": ".join(x for x in (s["reason"], s["message"]) if x)
            out.append(
                f"  {s['section']} {s['state']} (generation {s['generation']}){' ' + why if why else ''}"
            )
    was = {i["instance_id"]: i for i in previous.instances} if previous else {}
    for i in view.instances:
        if was.get(i["instance_id"]) != i:
            out.append(f"  instance {i['instance_id']} {i['state']} {i['message']}".rstrip())
    seen = {e["seq"] for e in previous.events} if previous else set()
    out.extend(f"  event {e['seq']} {e['type']}" for e in view.events if e["seq"] not in seen)
    return out


def holders_text(root: Path, data_dir: Path | None = None) -> str:
    """The holder of each GPU, MIG instance and slot, as `bcd status --root DIR` shows it (the GPUs
    passed through to instances from the node's status.json in `data_dir`)."""
    from bcd_simhost import sim_system

    from bcd_agent.status import StatusSnapshot, passthrough_of, read_holders
    from bcd_agent.status import render as render_status
    from bcd_agent.statusfile import StatusFileError, read_status

    status = None
    if data_dir is not None:
        try:
            status = read_status(data_dir)
        except (OSError, StatusFileError):
            status = None
    holds = read_holders(sim_system(root), passthrough_of(status))
    lines = render_status(StatusSnapshot(None, holds)).splitlines()
    table = next((i for i, line in enumerate(lines) if line.startswith("GPU")), len(lines))
    return "\n".join(lines[table:]) + "\n"  # the table only: not the version and "no status" lines


# --- the run ----------------------------------------------------------------------------------------------


def write_root_config(layout: Layout, *, node_uid: int | None, join_pin: str) -> None:
    """Root's config.toml for `bcd helper` on the simulated host.

    It pins the development control plane's join key, so the helper takes its command-signing roots
    from root's join record (host-config.md "Signed specs") and applies only signed host units. It names
    the node's account; root itself may always call the helper, so a node run as root (`--helper auto`)
    and one run as that account (`--helper yes`) both pass SO_PEERCRED.
    """
    account = NODE_UID if node_uid is None else node_uid
    root_lines = [
        "# bcd sim: root's config.toml for bcd helper (host paths under the simulated host)",
        f'join_signing_key_pin = "{join_pin}"',
        "",
        "[helper]",
        f'socket = "{layout.helper_socket_host_path}"',
        f"node_uid = {account}",
        f"node_gid = {account}",
        'instance_bridges = "br0"',
        # The simulated host has no nftables (bcd_simhost.netns): its node loads no rules, so root
        # cannot require a guest's signed rules before it starts (docs/config.md).
        "guest_network_rules = false",
    ]
    layout.root_config.parent.mkdir(parents=True, exist_ok=True)
    layout.root_config.write_text("\n".join(root_lines) + "\n")
    os.chmod(layout.root_config, 0o640)
    for d in (layout.root / "etc/bcd", layout.root / "etc", layout.root):
        os.chmod(d, 0o755)  # noqa: S103 - the helper's root-only rule: root writes, others read


@frozen
class SimOptions:
    spec: Path
    root: Path
    once: bool = False
    json: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    helper: str = "auto"  # auto (as root), yes, no
    fresh: bool = False
    settle_s: float = SETTLE_S


def use_helper(choice: str) -> tuple[bool, int | None]:
    """Whether to run the helper, and the uid the node runs as (None: this process's own).

    `auto` (the default): as root, `bcd helper` runs beside the node and every privileged step goes
    through it; the node runs as root too, which the helper admits (root may always call). `yes`: the
    production split, the node as NODE_UID. `no`: no helper; the node acts itself on the simulated host.
    """
    if choice == "no":
        return False, None
    if os.geteuid() != 0:
        if choice == "yes":
            raise SimError("--helper yes needs root (the helper runs as root, the node as uid 65534)")
        return False, None
    return True, (NODE_UID if choice == "yes" else None)


async def check_node_account(uid: int) -> None:
    """The node runs as `uid` beside the helper: it must be able to run this Python."""
    try:
        await trio.run_process(
            [sys.executable, "-c", "pass"], user=uid, group=uid, extra_groups=[], check=True
        )
    except (OSError, trio.TooSlowError) as e:
        raise SimError(
            f"--helper yes: uid {uid} cannot run {sys.executable} ({e}); install bcd where that account can "
            "read it (a venv outside /root), or use --helper auto (the node as root beside the helper)"
        ) from None
    except Exception as e:
        raise SimError(f"--helper yes: uid {uid} cannot run {sys.executable}: {e}") from None


async def simulate(
    opts: SimOptions,
    out: TextIO,
    *,
    on_started: Callable[[Layout, Any], None] | None = None,
) -> tuple[int, dict[str, object]]:
    """Run the simulation; returns (exit code, the final JSON document)."""
    from bcd_agent.devplane.plane import DevPlane
    from bcd_agent.earlystop import installed
    from bcd_agent.plan import load_spec_file

    # `bcd sim` installs an EarlyStop first thing: a signal before the receiver below takes over (the
    # imports, the seeding) is kept there, and honoured at the next of these checks. Without it the
    # default action killed the sim silently (SIGTERM: exit 143, no message; SIGINT: a traceback).
    early = installed()
    _stop_if_signalled(early)
    spec = load_spec_file(opts.spec)  # refused before anything starts, naming the field
    layout = Layout(opts.root.resolve())
    check_sim_root(layout.root)
    if opts.fresh and layout.root.exists():
        shutil.rmtree(layout.root)
    helper, node_user = use_helper(opts.helper)
    if node_user is not None:
        await check_node_account(node_user)
    prepare(layout, helper=helper, node_uid=node_user)
    _stop_if_signalled(early)
    tty = out.isatty() and not opts.json
    started = time.monotonic()

    # SIGINT and SIGTERM arrive as messages (not as KeyboardInterrupt raised wherever the main thread
    # happens to be: raised inside the control plane's grpclib/asyncio code it could be lost, and
    # `bcd sim` then never stopped): the nursery is cancelled, every child stopped, then Stopped.
    stopped: list[int] = []
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        _stop_if_signalled(early)  # one that came just before the receiver: no child started yet
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stop_on_signal, signals, nursery.cancel_scope, stopped)
            plane = DevPlane(layout.plane_dir, listen=None, unix_socket=layout.gateway_socket)
            await nursery.start(plane.run)
            if node_user is not None:
                os.chown(layout.gateway_socket, node_user, node_user)
            if helper:
                write_root_config(layout, node_uid=node_user, join_pin=plane.join_pin)
                helper_argv = bcd_argv("helper", "serve", "--root", str(layout.root))
                helper_child = Child("bcd helper", tuple(helper_argv), layout.log_dir / "helper.log")
                proc = await nursery.start(supervise, helper_child)
                await wait_for_socket(
                    layout.root / layout.helper_socket_host_path.lstrip("/"), proc, "bcd helper"
                )
            if not (layout.data_dir / "identity.json").exists():
                token = plane.issue_token()
                # `--token=T`: a token is URL-safe base64 and may begin with `-`, which argparse would
                # take for an option.
                await run_once(
                    bcd_argv("join", f"--token={token}", "--address", f"unix:{layout.gateway_socket}",
                             "--config", str(layout.node_config), "--root", str(layout.root)),
                    layout.log_dir / "join.log",
                    user=node_user,
                )  # fmt: skip
            node_id = plane.default_node()
            # A re-run keeps the control plane's record: the same spec keeps its generation, and the report
            # stored is the previous run's. Forget it, so that only this run's node can settle the view.
            forget_status(plane, node_id)
            node_child = Child("bcd node", tuple(bcd_argv("node", "--config", str(layout.node_config),
                                                          "--root", str(layout.root))),
                               layout.log_dir / "node.log", user=node_user)  # fmt: skip
            node_proc = await nursery.start(supervise, node_child)
            generation = plane.apply_spec(node_id, spec)
            if on_started is not None:
                on_started(layout, plane)
            if not opts.json:
                out.write(
                    f"bcd sim: node {node_id} on {layout.root}; applied {opts.spec}"
                    f" as generation {generation}\n"
                )
                out.flush()
            previous: SimView | None = None
            deadline = started + opts.timeout_s
            timed_out = False
            settler = Settler(opts.settle_s)
            while True:
                view = plane_view(plane, node_id)
                version = node_status_version(layout.data_dir)
                # data_dir/status.json of an earlier run's node (another pid) says nothing about this run.
                current = version is not None and version[0] == node_proc.pid
                settled = settler.update(view, version, time.monotonic(), current=current)
                if not opts.json:
                    if tty:
                        out.write(
                            "\x1b[H\x1b[2J"
                            + render(view, elapsed_s=time.monotonic() - started, spec=str(opts.spec))
                        )
                    else:
                        for line in change_lines(previous, view):
                            out.write(line + "\n")
                    out.flush()
                previous = view
                if opts.once and settled:
                    break
                if opts.once and time.monotonic() >= deadline:
                    # Observed but still changing at the deadline: the latest status, not a time-out.
                    timed_out = not view.settled
                    break
                await trio.sleep(0.1 if opts.once else 0.5)
            nursery.cancel_scope.cancel()
    if stopped:
        raise Stopped(stopped[0])

    doc = view.to_json(timed_out=timed_out, root=str(layout.root))
    if not opts.json:
        verdict = "converged" if view.converged else "timed out" if timed_out else "settled, not converged"
        out.write("\n" + render(view, elapsed_s=time.monotonic() - started, spec=str(opts.spec)))
        out.write(holders_text(layout.root, layout.data_dir))
        if helper:
            out.write(audit_summary(layout.root))
        out.write(f"bcd sim: {verdict}; the simulated host stays in {layout.root}\n")
    return (0 if view.converged else 1), doc


def audit_summary(root: Path) -> str:
    """One line per (op, decision) from the helper's audit log: what root did for the node."""
    log = root / "var/log/bcd-helper/audit.log"
    counts: dict[tuple[str, str], int] = {}
    try:
        lines = log.read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        key = (str(entry.get("op", "?")), str(entry.get("decision", "?")))
        counts[key] = counts.get(key, 0) + 1
    body = ", ".join(f"{n} {op} {decision}" for (op, decision), n in sorted(counts.items()))
    # `show`, not `verify`: the sim's helper starts without `audit init`, so no one holds the key that
    # `verify --key` needs (docs/helper.md "Audit log").
    show = f"bcd helper audit --root {root} show"
    return f"bcd helper (root): {body or 'no requests'}; read its audit log: {show}\n"


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


# --- CLI --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spec", default="examples/gpu-node.json", help="a NodeSpec in protobuf's JSON mapping"
    )
    parser.add_argument(
        "--root", default=DEFAULT_ROOT, help=f"the simulated host (seeded if new; default {DEFAULT_ROOT})"
    )
    parser.add_argument("--once", action="store_true", help="end when the spec is observed (or at --timeout)")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object at the end (implies --once)"
    )
    from bcd_shared.subcommands import positive_float

    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=None,
        help=f"seconds to wait (--once or --json only; default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--helper",
        choices=("auto", "yes", "no"),
        default="auto",
        help=(
            "auto (default): as root, run bcd helper beside the node; "
            "yes: also run the node as uid 65534; no: the node acts itself"
        ),
    )
    parser.add_argument("--fresh", action="store_true", help="remove DIR first and start from a new host")


def run(args: argparse.Namespace) -> int:
    from bcd_shared.simroot import SimHostMissing, simhost_module
    from bcd_shared.subcommands import EX_USAGE, CliError

    from bcd_agent.earlystop import installed
    from bcd_agent.plan import SpecFileError

    try:
        simhost_module(args.root)  # `bcd sim` is the simulated host: it needs bcd-simhost
    except SimHostMissing as e:
        raise CliError(str(e), EX_USAGE) from None
    if args.timeout is not None and not (args.once or args.json):
        # Without --once the sim runs until stopped: a --timeout there would be ignored.
        raise CliError("--timeout applies to --once (or --json) only", EX_USAGE)
    try:
        check_sim_root(Path(args.root))  # before anything: never seed into, nor --fresh remove, a real dir
    except SimError as e:
        raise CliError(str(e), EX_USAGE) from None

    opts = SimOptions(
        spec=Path(args.spec),
        root=Path(args.root),
        once=args.once or args.json,
        json=args.json,
        timeout_s=DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout,
        helper=args.helper,
        fresh=args.fresh,
    )
    try:
        _stop_if_signalled(installed())  # during the imports
        code, doc = trio.run(simulate, opts, sys.stdout)
    except Stopped as e:
        print(e.message(), file=sys.stderr)
        return 128 + e.signum
    except SpecFileError as e:
        print(f"bcd sim: {e}", file=sys.stderr)
        return 2
    except SimError as e:
        print(f"bcd sim: {e}", file=sys.stderr)
        return 2
    except BaseExceptionGroup as eg:
        interrupted, _ = eg.split(KeyboardInterrupt)
        if interrupted is not None:
            print("bcd sim: stopped", file=sys.stderr)
            return 130
        sim_errors, _ = eg.split(SimError)
        if sim_errors is None:
            raise
        for leaf in _leaves(sim_errors):
            print(f"bcd sim: {leaf}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bcd sim: stopped", file=sys.stderr)
        return 130
    if args.json:
        json.dump(doc, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    return code
