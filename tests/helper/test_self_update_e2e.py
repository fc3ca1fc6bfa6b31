"""Self-update end to end on a simulated host, with real builds: three wheels of bcd-agent at different
versions (0.9.0, 1.0.0, 1.1.0, built here with pip from this tree, with bcd-shared and bcd-helper) made
into release artifacts (`bcd release build`), served over real HTTPS, downloaded by the node's daemon
section running as the node's uid, verified and swapped in by a real `bcd helper serve`, and confirmed
by the new release itself running (`bcd release confirm` from the installed artifact). Then a release
that never confirms is rolled back by root's timer and not retried from the same spec, and the old
release replayed in a newer spec is refused. And the command path: `daemon.upgrade` swaps with the signed
command as the release's freshness, and completes when the journal runs it again in the new release.

Covers DLV-CONV-15 (the node converges `daemon` under the helper, downloading the release itself),
DLV-CONV-16 (the helper verifies and swaps it), DLV-PRIV-10 (verify, swap, confirm, roll back through
the helper), DLV-SPEC-08 (the section's version, URL, SHA-256 and signature are what is installed).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections.daemon.release import build_release
from bcd_agent.sections.daemon.section import DaemonSection
from bcd_agent.sections.daemon.upgrade import Upgrader
from bcd_agent.sections.host.intent import write_host_intent
from bcd_shared import wire
from bcd_shared.pki import Purpose
from bcd_shared.release import ReleaseManifest, sign_release
from helperproc import HelperProcess, base_config
from intentkit import ControlPlane, Signer
from releasekit import LINK, NODE_ID, NODE_UID, RECORD
from testsupport import REPO
from tlskit import HTTPS_FILE_SERVER, make_tls

VERSIONS = ("0.9.0", "1.0.0", "1.1.0")
PY = sys.executable


@pytest.fixture(scope="module")
def work() -> Iterator[Path]:
    """A directory every uid can traverse (pytest's are 0700 root, and the node runs as its own uid)."""
    d = Path(tempfile.mkdtemp(prefix="bcd-selfupdate-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _pip_wheel(src: Path, out: Path) -> None:
    subprocess.run(
        [PY, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def releases(work: Path) -> dict[str, Path]:
    """version -> a release artifact built from this tree's wheels, bcd-agent at that version."""
    src, wheels = work / "src", work / "wheels"
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    for name in ("shared", "helper"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
        _pip_wheel(src / name, wheels / "common")
    out: dict[str, Path] = {}
    for version in VERSIONS:
        tree = src / f"agent-{version}"
        shutil.copytree(REPO / "agent", tree, ignore=ignore)
        project = tree / "pyproject.toml"
        text = project.read_text()
        assert 'version = "0.1.0"' in text
        project.write_text(text.replace('version = "0.1.0"', f'version = "{version}"', 1))
        _pip_wheel(tree, wheels / version)
        artifact = work / f"bcd-{version}.pyz"
        build_release(
            sorted((wheels / "common").glob("*.whl")) + sorted((wheels / version).glob("*.whl")), artifact
        )
        out[version] = artifact
    return out


def run_release(path: Path, *args: str) -> str:
    """Run a release artifact as a program; its output."""
    done = subprocess.run([PY, str(path), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout.strip()


def test_the_builds_are_real_and_know_their_versions(releases: dict[str, Path]) -> None:
    for version, artifact in releases.items():
        assert run_release(artifact, "release", "version") == version


# --- an HTTPS release server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(work: Path, releases: dict[str, Path]) -> Iterator[tuple[str, Path]]:
    """(base URL, CA file) of an HTTPS server serving /bcd/<version>/bcd."""
    ca, cert, key = make_tls(work)
    docroot = work / "www"
    for version, artifact in releases.items():
        (docroot / "bcd" / version).mkdir(parents=True)
        shutil.copy(artifact, docroot / "bcd" / version / "bcd")
    proc = subprocess.Popen(
        [PY, "-c", HTTPS_FILE_SERVER, str(docroot), str(cert), str(key), "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield f"https://127.0.0.1:{port}", ca
    proc.terminate()
    proc.wait(10)


# --- the node, as its own uid ------------------------------------------------------------------------------


def as_node(
    h: HelperProcess, ca: Path, running: str, act: Callable[[Upgrader], dict[str, Any]], timeout_s: int = 600
) -> dict[str, Any]:
    """Run `act` with the node's Upgrader in a child process of the node's uid and gid; what it returns,
    or its exception as {error, reason, message}."""
    data_dir = h.root / "var/lib/bcd"
    # The child of the node's uid cannot read the interpreter's files (they are under /root): whatever
    # it imports lazily is imported here first.
    for module in ("encodings.idna", "urllib.request", "http.client", "email.parser", "hmac"):
        importlib.import_module(module)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NODE_UID)
            os.setuid(NODE_UID)
            upgrader = Upgrader(
                HelperClient(h.socket_path),
                data_dir,
                running,
                ssl_context=lambda: ssl.create_default_context(cafile=str(ca)),
                confirm_timeout_s=timeout_s,
            )
            try:
                doc = act(upgrader)
            except Exception as exc:  # reported to the parent
                reason = getattr(exc, "reason", getattr(exc, "code", ""))
                doc = {"error": type(exc).__name__, "reason": reason, "message": str(exc)}
            os.write(write, json.dumps(doc).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    _pid, status = os.waitpid(pid, 0)
    assert status == 0, data
    return dict(json.loads(data))


def node_pass(
    h: HelperProcess,
    ca: Path,
    running: str,
    section: wire.DaemonSection,
    generation: int,
    *,
    timeout_s: int = 600,
) -> dict[str, Any]:
    """One pass of the node's daemon section, as the node's uid: its outcome ({state, reason, message})."""

    def act(upgrader: Upgrader) -> dict[str, Any]:
        spec = DesiredSpec(generation=generation, spec_hash=f"h{generation}", sections={"daemon": section})
        ctx = PassContext(spec=spec, pass_number=1, reasons=frozenset({"spec"}), now_monotonic=0.0)
        out = DaemonSection(upgrader, h.root / "var/lib/bcd").converge(section, Observation(), ctx)
        return {"state": out.state.name, "reason": out.reason, "message": out.message}

    return as_node(h, ca, running, act, timeout_s)


def signed_spec(
    h: HelperProcess,
    signer: Signer,
    section: wire.DaemonSection,
    generation: int,
    devices: wire.DevicesSection | None = None,
) -> None:
    """The control plane's signed spec at `generation`, as the session keeps it (host-intent.json)."""
    body = bytes(
        wire.DesiredStateBody(
            node_id=NODE_ID,
            generation=generation,
            spec_hash=f"h{generation}",
            full=wire.NodeSpec(daemon=section, devices=devices),
        )
    )
    path = write_host_intent(
        h.root / "var/lib/bcd",
        generation=generation,
        body=body,
        signature=signer.key.sign(Purpose.DESIRED_STATE, body),
        signer_chain=signer.chain,
    )
    os.chown(path, NODE_UID, NODE_UID)


def release_section(signer: Signer, base: str, version: str, artifact: Path) -> wire.DaemonSection:
    import hashlib

    digest = hashlib.sha256(artifact.read_bytes()).hexdigest()
    url = f"{base}/bcd/{version}/bcd"
    signature = sign_release(signer.key, ReleaseManifest(version, url, digest))
    return wire.DaemonSection(version=version, url=url, sha256=digest, signature=signature)


@pytest.fixture
def host(work: Path, releases: dict[str, Path]) -> Iterator[tuple[HelperProcess, ControlPlane]]:
    from helperproc import make_root

    parent = Path(tempfile.mkdtemp(dir=work))
    root = make_root(parent)
    cp = ControlPlane.build()
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / "usr/lib/bcd").mkdir(parents=True)
    shutil.copy(releases["0.9.0"], root / LINK)  # the packaged install: release 0.9.0
    unit = root / "etc/systemd/system/bcd-node.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/bin/bcd node\n")
    data_dir = root / "var/lib/bcd"
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chown(data_dir, NODE_UID, NODE_UID)
    data_dir.chmod(0o700)
    h = HelperProcess(root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_UID))
    yield h, cp
    h.stop()


def _record(h: HelperProcess) -> dict[str, Any]:
    return dict(json.loads((h.root / RECORD).read_text()))


def test_DLV_CONV_15_16_DLV_PRIV_10_upgrade_confirm_roll_back_and_refuse_a_replay(
    host: tuple[HelperProcess, ControlPlane], server: tuple[str, Path], releases: dict[str, Path]
) -> None:
    h, cp = host
    base, ca = server
    worker = cp.command.leaf()
    installed = h.root / LINK
    assert run_release(installed, "release", "version") == "0.9.0"

    # Generation 1 names 1.0.0: the node (running 0.9.0) downloads it, the helper swaps it in.
    v100 = release_section(worker, base, "1.0.0", releases["1.0.0"])
    signed_spec(h, worker, v100, 1)
    out = node_pass(h, ca, "0.9.0", v100, 1)
    assert (out.get("state"), out.get("reason")) == ("PROGRESSING", "Restarting"), out
    assert os.readlink(installed) == "releases/1.0.0/bcd"
    assert installed.read_bytes() == releases["1.0.0"].read_bytes()
    assert "restart bcd-node.service" in (h.root / "var/lib/bcd-sim/systemd/log").read_text()
    assert _record(h)["state"] == "pending"
    # The restart: the installed release runs and confirms itself.
    assert run_release(installed, "release", "version") == "1.0.0"
    assert "confirmed=True" in run_release(installed, "release", "confirm", "--socket", h.socket_path)
    assert _record(h)["state"] == "confirmed"
    # The node on 1.0.0: converged, nothing downloaded or swapped again.
    assert node_pass(h, ca, "1.0.0", v100, 1) == {
        "state": "CONVERGED",
        "reason": "Running",
        "message": "running 1.0.0",
    }

    # Generation 2 names 1.1.0, which never confirms: root's timer rolls it back to 1.0.0.
    v110 = release_section(worker, base, "1.1.0", releases["1.1.0"])
    signed_spec(h, worker, v110, 2)
    out = node_pass(h, ca, "1.0.0", v110, 2, timeout_s=2)
    assert out.get("reason") == "Restarting", out
    assert run_release(installed, "release", "version") == "1.1.0"
    deadline = time.monotonic() + 15
    while _record(h)["state"] == "pending" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _record(h)["state"] == "rolled-back"
    assert os.readlink(installed) == "releases/1.0.0/bcd"
    assert run_release(installed, "release", "version") == "1.0.0"
    # The same spec again does not swap the failed release in again: FAILED with root's reason.
    out = node_pass(h, ca, "1.0.0", v110, 2)
    assert (out.get("error"), out.get("reason")) == ("TerminalError", "release-failed"), out

    # Generation 3 replays the control plane's earlier, validly signed 0.9.0 release: refused, terminal.
    v090 = release_section(worker, base, "0.9.0", releases["0.9.0"])
    signed_spec(h, worker, v090, 3)
    before = (os.readlink(installed), _record(h))
    out = node_pass(h, ca, "1.0.0", v090, 3)
    assert (out.get("error"), out.get("reason")) == ("TerminalError", "downgrade"), out
    assert (os.readlink(installed), _record(h)) == before
    assert run_release(installed, "release", "version") == "1.0.0"


class _Ctx:
    boot_id = "boot-1"
    cancel_requested = False

    async def begin_effect(self) -> None:
        pass


def _upgrade_command(signer: Signer, section: wire.DaemonSection) -> Any:
    from bcd_agent.dispatch.wire import envelope_from_wire
    from bcd_shared.wire.strict import type_url

    request = wire.DaemonUpgradeRequest(
        version=section.version, url=section.url, sha256=section.sha256, signature=section.signature
    )
    body = bytes(
        wire.CommandBody(
            id="01J00000000000000000E2EXPG",
            node_id=NODE_ID,
            seq=1,
            kind="daemon.upgrade",
            payload=wire.ProtoAny(type_url=type_url(wire.DaemonUpgradeRequest), value=bytes(request)),
            lane=wire.Lane.CONTROL,
            not_after=int(time.time() * 1000) + 600_000,
            retry_safe=True,
            self_terminating=True,
        )
    )
    signature = signer.key.sign(Purpose.COMMAND, body)
    return envelope_from_wire(wire.Command(body=body, signature=signature, signer_chain=list(signer.chain)))


def test_DLV_PRIV_10_daemon_upgrade_swaps_then_completes_in_the_new_release(
    host: tuple[HelperProcess, ControlPlane], server: tuple[str, Path], releases: dict[str, Path]
) -> None:
    """The command path: the signed daemon.upgrade command itself is the release's freshness; the handler
    swaps and waits for the restart; the journal re-executes it in the new release, which confirms."""
    from bcd_agent.kinds.daemon import DaemonUpgradeHandler

    h, cp = host
    base, ca = server
    worker = cp.command.leaf()
    command = _upgrade_command(worker, release_section(worker, base, "1.0.0", releases["1.0.0"]))

    def run(upgrader: Upgrader) -> dict[str, Any]:
        out = trio.run(DaemonUpgradeHandler(upgrader, wait_s=0.2).run, command, _Ctx())
        result = wire.DaemonUpgradeResult.parse(out)
        return {"version": result.version, "previous_version": result.previous_version}

    first = as_node(h, ca, run_release(h.root / LINK, "release", "version"), run)
    assert (first["error"], first["reason"]) == ("CommandFailed", "restart-timeout"), first  # no systemd here
    assert os.readlink(h.root / LINK) == "releases/1.0.0/bcd"
    assert _record(h)["used_commands"] == ["01J00000000000000000E2EXPG"]
    # The restart: the journal runs the retry-safe command again in the new release, which confirms.
    again = as_node(h, ca, run_release(h.root / LINK, "release", "version"), run)
    assert again == {"version": "1.0.0", "previous_version": ""}, again
    assert _record(h)["state"] == "confirmed"


def test_DLV_PRIV_11_an_unprivileged_node_binds_releases_and_updates_beside_the_helper(
    host: tuple[HelperProcess, ControlPlane], server: tuple[str, Path], releases: dict[str, Path]
) -> None:
    """DLV-PRIV-11: the node as its own uid beside a real `bcd helper serve` with signing roots. One signed
    spec holds GPU 0 for allocation a1 and names release 1.0.0: the node's devices section (composed by
    `Node` from a config naming the helper's socket) binds the hold
    through root's file.write (the node itself cannot write /etc/cdi), its daemon section downloads the
    release and root swaps it in, and the new release confirms itself. The next signed spec drops the hold:
    released through root's file.remove, while the release stays confirmed. Root's audit log shows each
    op accepted for the node's uid."""
    from types import SimpleNamespace

    from bcd_agent.config import load_config
    from bcd_agent.node import Node, NodeOptions
    from bcd_agent.sections.devices.events import KeyReportSigner, MemorySink
    from bcd_agent.sections.devices.model import spec_from_wire
    from bcd_simhost.gpus import gpu_uuid
    from helperproc import make_root

    h, cp = host
    base, ca = server
    worker = cp.command.leaf()
    data_dir = h.root / "var/lib/bcd"
    cdi_path, env_path = h.root / "etc/cdi/bcd-a1.json", h.root / "run/bcd/allocations/a1.env"
    v100 = release_section(worker, base, "1.0.0", releases["1.0.0"])
    a1 = wire.DeviceAssignment(
        allocation_id="a1",
        reservation_id="r1",
        binding=wire.Binding.HOLD,
        devices=[wire.DeviceAtom(id=gpu_uuid(0), device_class="gpu")],
    )
    # The node's own composition (`bcd node`'s Node._sections) from a config naming the helper's socket,
    # not a section wired here: a node that never used the helper for holds fails below (its own uid
    # cannot write /etc/cdi, and root's audit log would show no file op).
    toml = '[host]\nunits = false\n[helper]\nsocket = "/run/bcd/helper.sock"\n'
    config = data_dir / "node.toml"  # etc/bcd is root's: the node's own directory holds its config here
    config.write_text(f'data_dir = "{data_dir}"\n{toml}')
    os.chown(config, NODE_UID, NODE_UID)

    def node_devices(root: Path, toml: Path) -> Any:
        node = Node(load_config(str(toml)), NodeOptions(root=str(root)))
        node.secrets = SimpleNamespace(fetch=print)  # built by `run`; the telemetry section keeps it
        signer = KeyReportSigner.fresh(NODE_ID, "boot-1")
        sink = MemorySink()
        sections = node._sections(node._system(), sink, signer, SimpleNamespace(node_id=NODE_ID), None)
        [devices] = [s for s in sections if s.name == "devices"]
        return devices, sink

    # The child of the node's uid cannot import from /root: the composition is made once here first (on
    # a scratch root), so every module it imports lazily is loaded before the fork.
    scratch = make_root(Path(tempfile.mkdtemp(dir=h.root.parent)))
    (scratch / "etc/bcd").mkdir(parents=True, exist_ok=True)
    (scratch / "etc/bcd/node.toml").write_text(f'data_dir = "{scratch / "var/lib/bcd"}"\n{toml}')
    node_devices(scratch, scratch / "etc/bcd/node.toml")

    def devices_pass(section: wire.DevicesSection, generation: int) -> dict[str, Any]:
        def act(_upgrader: Upgrader) -> dict[str, Any]:
            devices, sink = node_devices(h.root, config)
            spec = DesiredSpec(generation=generation, spec_hash=f"h{generation}")
            ctx = PassContext(spec=spec, pass_number=1, reasons=frozenset({"spec"}), now_monotonic=0.0)
            out = devices.converge(spec_from_wire(generation, section), Observation(), ctx)
            events = [type(e.event).__name__ for e in sink.events]
            return {"state": out.state.name, "message": out.message, "events": events, "uid": os.getuid()}

        return as_node(h, ca, "0.9.0", act)

    # Generation 1: the hold and the release, signed together.
    signed_spec(h, worker, v100, 1, wire.DevicesSection(assignments=[a1]))
    bound = devices_pass(wire.DevicesSection(assignments=[a1]), 1)
    assert bound == {"state": "CONVERGED", "message": "", "events": ["BoundEvent"], "uid": NODE_UID}, bound
    assert cdi_path.stat().st_uid == 0 and gpu_uuid(0) in cdi_path.read_text()
    assert env_path.read_text().startswith("BCD_ALLOCATION_ID=a1\n")
    out = node_pass(h, ca, "0.9.0", v100, 1)
    assert (out.get("state"), out.get("reason")) == ("PROGRESSING", "Restarting"), out
    assert "confirmed=True" in run_release(h.root / LINK, "release", "confirm", "--socket", h.socket_path)
    assert _record(h)["state"] == "confirmed" and run_release(h.root / LINK, "release", "version") == "1.0.0"

    # Generation 2 drops the hold: root removes both files; the release stays.
    signed_spec(h, worker, v100, 2, wire.DevicesSection())
    released = devices_pass(wire.DevicesSection(), 2)
    assert (released["state"], released["events"]) == ("CONVERGED", ["ReleasedEvent"]), released
    assert not cdi_path.exists() and not env_path.exists()
    assert _record(h)["state"] == "confirmed"
    audit = h.audit_lines()
    done = [
        (a["op"], a["args"].get("kind"))
        for a in audit
        if a.get("decision") == "accepted" and a.get("peer_uid") == NODE_UID and a["op"].startswith("file.")
    ]
    assert done == [("file.write", "cdi"), ("file.write", "allocation-env"),
                    ("file.remove", "cdi"), ("file.remove", "allocation-env")], done  # fmt: skip
    swaps = [a for a in audit if a["op"] == "daemon.swap" and a.get("decision") == "accepted"]
    assert [a.get("peer_uid") for a in swaps] == [NODE_UID]
