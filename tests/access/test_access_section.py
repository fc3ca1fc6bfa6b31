"""The `access` section's converger (agent/bcd_agent/sections/access) and the shared plan (bcd_shared.access).

Plan, apply to a simulated host, plan again: no steps. The node as root (DirectExecutor over the simulated
host) and under a real `bcd helper serve` (HelperExecutor: one `access.apply` with the kept signed spec)
write the same bytes. The session refuses a spec whose access section breaks DLV-ACC-09..11.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest
from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import DesiredSpec, SectionState
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections import access as ax
from bcd_agent.sections.host.intent import intent_args, read_host_intent, write_host_intent
from bcd_agent.session import spec as specmod
from bcd_shared import access as acc
from bcd_shared import wire
from bcd_shared.errors import TerminalError
from bcd_simhost import sim_system
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from helper.helperproc import HelperProcess, base_config
from helper.intentkit import ControlPlane, access_body, unsigned

NODE = "node-a"


def key() -> str:
    return (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
        .decode()
    )


K1, K2 = key(), key()
CTX = PassContext(DesiredSpec(1, "h"), 1, frozenset(), 0.0)


def section(**kw: object) -> wire.AccessSection:
    return wire.AccessSection(**kw)  # type: ignore[arg-type]


def run(sec: ax.AccessSection, desired: object) -> tuple[bool, str, SectionState]:
    out = sec.converge(desired, Observation(), CTX)
    return out.changed, out.message, out.state


def sshd_active(root: Path) -> None:
    unit = root / "lib/systemd/system/ssh.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/usr/sbin/sshd -D\n")
    state = root / "var/lib/bcd-sim/systemd/units.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"ssh.service": {"active": True, "enabled": True, "properties": {}}}))


def test_DLV_ACC_05_06_plan_apply_plan_again_is_empty(sim_root: Path) -> None:
    """The pure plan: files then the drop-in, a reload only when the drop-in changes, nothing the second
    time; an emptied section removes everything, the drop-in first."""
    system = sim_system(sim_root)
    desired = acc.render([K1], [f"alice@{NODE}"], [3], NODE)
    steps = acc.plan(desired, ax.observe(system))
    assert [type(s).__name__ for s in steps][-2:] == ["Write", "Reload"]
    assert isinstance(steps[-2], acc.Write) and steps[-2].path == acc.SSHD_DROPIN
    for s in steps:
        if isinstance(s, acc.Write):
            system.write_atomic(s.path, s.data)
    assert acc.plan(desired, ax.observe(system)) == ()
    other = acc.render([K2], [f"bob@{NODE}"], [3], NODE)  # same drop-in: no reload
    steps = acc.plan(other, ax.observe(system))
    assert acc.Reload() not in steps
    assert acc.Remove(acc.principals_path("alice")) in steps
    empty = acc.render([], [], [], NODE)
    steps = acc.plan(empty, ax.observe(system))
    assert steps[0] == acc.Remove(acc.SSHD_DROPIN) and steps[-1] == acc.Reload()


def test_DLV_ACC_01_to_04_06_08_direct_executor_on_the_simulated_host(sim_root: Path) -> None:
    """Covers DLV-ACC-01..04 (the CA keys, this node's principals only, the KRL and the drop-in, under
    /etc/ssh), DLV-ACC-06 and DLV-ACC-08 (the JWKS taken anew on a pass that changes no file). No reload
    on a change that leaves the drop-in alone is the plan tests'."""
    sshd_active(sim_root)
    system = sim_system(sim_root)
    sec = ax.AccessSection(ax.DirectExecutor(system), NODE)
    desired = section(
        exec_ticket_jwks='{"keys":[]}',
        ssh_ca_keys=[K1],
        principals=[f"alice@{NODE}", "bob@node-b"],
        revoked_serials=[5],
    )
    changed, what, state = run(sec, desired)
    assert changed and state is SectionState.CONVERGED and "reload ssh.service" in what
    files = acc.render([K1], [f"alice@{NODE}", "bob@node-b"], [5], NODE).files
    assert sorted(files) == sorted([acc.SSHD_CA, acc.principals_path("alice"), acc.SSHD_KRL, acc.SSHD_DROPIN])
    assert all(path.startswith("/etc/ssh/") for path in files)
    for path, data in files.items():
        assert system.read_bytes(path) == data
    assert K1 in (system.read_text(acc.SSHD_CA) or "")
    assert (system.read_text(acc.principals_path("alice")) or "").split() == [f"alice@{NODE}"]
    krl = system.read_bytes(acc.SSHD_KRL) or b""
    assert krl.startswith(acc.KRL_MAGIC) and krl.endswith((5).to_bytes(8, "big"))  # the one serial, last
    assert system.read_text(acc.SSHD_DROPIN) == acc.DROPIN_TEXT
    assert system.read_bytes(acc.principals_path("bob")) is None
    assert sec.current_jwks() == '{"keys":[]}'
    # Nothing changes in the files, the JWKS is taken anew anyway (DLV-ACC-08).
    desired2 = section(
        exec_ticket_jwks='{"keys":[1]}', ssh_ca_keys=[K1], principals=[f"alice@{NODE}"], revoked_serials=[5]
    )
    assert run(sec, desired2)[:2] == (False, "")
    assert sec.current_jwks() == '{"keys":[1]}'
    log = (sim_root / "var/lib/bcd-sim/systemd/log").read_text()
    assert log.count("reload ssh.service") == 1
    # Emptied: everything goes.
    assert sec.is_empty(None) and not sec.is_empty(desired2)
    changed, what, _ = run(sec, None)
    assert changed and all(system.read_bytes(p) is None for p in files)


def test_DLV_ACC_12_converger_checks_again_and_fails_terminally(sim_root: Path) -> None:
    sec = ax.AccessSection(ax.DirectExecutor(sim_system(sim_root)), NODE)
    for bad in (
        section(principals=[f"al ice@{NODE}"]),
        section(ssh_ca_keys=["ssh-ed25519 AAAA\u00a0"]),
        section(principals=[f"a\x01@{NODE}"]),
        section(ssh_ca_keys=["ssh-ed25519"]),  # DLV-ACC-10: not exactly one OpenSSH key
    ):
        with pytest.raises(TerminalError) as exc:
            sec.converge(bad, Observation(), CTX)
        assert exc.value.reason == "InvalidAccess"
    assert not (sim_root / "etc/ssh/bcd").exists()


def test_uid0_account_refused_as_root_unless_configured(sim_root: Path) -> None:
    (sim_root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    desired = section(ssh_ca_keys=[K1], principals=[f"root@{NODE}"])
    with pytest.raises(TerminalError) as exc:
        ax.AccessSection(ax.DirectExecutor(sim_system(sim_root)), NODE).converge(desired, Observation(), CTX)
    assert exc.value.reason == "RootPrincipal"
    sec = ax.AccessSection(ax.DirectExecutor(sim_system(sim_root), root_principals=True), NODE)
    assert run(sec, desired)[0] is True


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("principals", f"al ice@{NODE}"),
        ("principals", f"alice@{NODE}\n"),
        ("principals", "alice\u2003@x"),
        ("ssh_ca_keys", "ssh-ed25519"),
        ("ssh_ca_keys", f"{K1}\u0085"),
        # DLV-ACC-09 at its edges, each the only fault of its string: DEL (0x7F), a tab, NUL, and a
        # control character in a CA key's comment (which the key's own parse never reads).
        ("principals", f"alice\x7f@{NODE}"),
        ("principals", f"alice\t@{NODE}"),
        ("principals", f"\x00alice@{NODE}"),
        ("ssh_ca_keys", f"{K1} ops\x1bkey"),
        ("ssh_ca_keys", f"{K1} ops\x7fkey"),
    ],
)
def test_DLV_ACC_09_10_11_the_session_refuses_the_whole_spec(field: str, value: str) -> None:
    """Signed or not, a spec whose access section could add a line to an sshd file is refused as a
    whole (Q-DLV-ACC-03: not applied, the held generation stays). A control character is named as one
    (DLV-ACC-09: refused, never stripped)."""
    spec = wire.NodeSpec(access=wire.AccessSection(**{field: [value]}), host=wire.HostSection())
    body = bytes(wire.DesiredStateBody(node_id=NODE, generation=2, spec_hash="x", full=spec))
    verdict = specmod.judge(
        wire.DesiredState(body=body), node_id=NODE, applied=None, trust=None, now=dt.datetime.now(dt.UTC)
    )
    assert isinstance(verdict, specmod.Refused) and "invalid access section" in verdict.reason
    control = [c for c in value if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0]
    if control:
        assert f"a control character (U+{ord(control[0]):04X})" in verdict.reason, verdict.reason
    ok = bytes(
        wire.DesiredStateBody(
            node_id=NODE,
            generation=2,
            spec_hash="x",
            full=wire.NodeSpec(access=section(principals=[f"alice@{NODE}"])),
        )
    )
    assert isinstance(
        specmod.judge(
            wire.DesiredState(body=ok), node_id=NODE, applied=None, trust=None, now=dt.datetime.now(dt.UTC)
        ),
        specmod.Accepted,
    )


def test_DLV_PRIV_07_under_the_helper_root_writes_the_same_bytes(tmp_path: Path, sim_root: Path) -> None:
    """Beside a real helper with roots (root's join record), the node's section sends one access.apply
    with the signed spec it keeps; root writes exactly what the node as root would."""
    cp = ControlPlane.build()
    cp.write_record(sim_root, NODE, cp.bundle(1))
    helper = HelperProcess(sim_root, cp.config_lines() + base_config())
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    try:
        worker = cp.command.leaf()
        body = access_body(NODE, 4, ca_keys=(K1,), principals=(f"alice@{NODE}",), serials=(9,))
        write_host_intent(
            data_dir,
            generation=4,
            body=body,
            signature=worker.key.sign(_purpose(), body),
            signer_chain=worker.chain,
        )
        executor = ax.HelperExecutor(
            HelperClient(helper.socket_path),
            lambda: intent_args(read_host_intent(data_dir), None),
            sim_system(sim_root),  # the node reads the files (0644) to skip root when they match
        )
        sec = ax.AccessSection(executor, NODE)
        desired = section(ssh_ca_keys=[K1], principals=[f"alice@{NODE}"], revoked_serials=[9])
        changed, what, state = run(sec, desired)
        assert changed and state is SectionState.CONVERGED and acc.SSHD_DROPIN in what
        system = sim_system(sim_root)
        for path, data in acc.render([K1], [f"alice@{NODE}"], [9], NODE).files.items():
            assert system.read_bytes(path) == data
        assert run(sec, desired)[:2] == (False, "")
        assert [a["op"] for a in helper.audit_lines()].count("access.apply") == 1  # nothing to ask again
    finally:
        helper.stop()


def _purpose() -> object:
    from bcd_shared.pki import Purpose

    return Purpose.DESIRED_STATE


def test_bcd_plan_lists_the_access_steps_then_nothing(sim_root: Path) -> None:
    from bcd_agent.plan import plan_access

    desired = section(ssh_ca_keys=[K1], principals=[f"alice@{NODE}", "bob@node-b"])
    first = plan_access(desired, sim_system(sim_root), NODE)
    assert first.steps[-2:] == (f"write {acc.SSHD_DROPIN}", "reload sshd") and first.notes
    run(ax.AccessSection(ax.DirectExecutor(sim_system(sim_root)), NODE), desired)
    assert plan_access(desired, sim_system(sim_root), NODE).converged
    assert plan_access(section(principals=["a b"]), sim_system(sim_root), NODE).failures


def test_DLV_ACC_05_a_failed_reload_is_retried_on_the_next_pass(sim_root: Path) -> None:
    """sshd refused the reload (systemd, faked here as PID 1 is): the drop-in is taken away again, so the
    next pass sees the change and reloads once more, instead of leaving sshd on its old config."""
    from bcd_shared.system import CommandResult, LocalSystem

    sshd_active(sim_root)
    inner = sim_system(sim_root)
    failing = {"on": True}

    class ReloadFails(LocalSystem):
        def run(self, argv, *, timeout=60.0, input=None):  # type: ignore[no-untyped-def,override]
            if failing["on"] and list(argv[:2]) == ["systemctl", "reload"]:
                return CommandResult(tuple(argv), 1, b"", b"Job for ssh.service failed.\n")
            return inner.run(argv, timeout=timeout, input=input)

    system = ReloadFails(root=sim_root)
    sec = ax.AccessSection(ax.DirectExecutor(system), NODE)
    desired = section(ssh_ca_keys=[K1], principals=[f"alice@{NODE}"])
    from bcd_shared.errors import RetryableError

    with pytest.raises(RetryableError) as exc:
        sec.converge(desired, Observation(), CTX)
    assert exc.value.reason == "SshdReload" and system.read_bytes(acc.SSHD_DROPIN) is None
    failing["on"] = False
    changed, what, _ = run(sec, desired)
    assert (
        changed
        and "reload ssh.service" in what
        and system.read_bytes(acc.SSHD_DROPIN) == acc.DROPIN_TEXT.encode()
    )


def test_root_config_refusals_fail_the_section_terminally(tmp_path: Path, sim_root: Path) -> None:
    """Beside a helper without roots and without `unsigned_access`, access.apply is refused for good:
    the section is FAILED (terminal), not PROGRESSING forever; a passing helper error stays retryable."""
    from bcd_shared.errors import HelperRefused

    helper = HelperProcess(sim_root, base_config())
    try:
        body = access_body(NODE, 1, ca_keys=(K1,), principals=(f"alice@{NODE}",))
        arg = unsigned(body)
        sec = ax.AccessSection(ax.HelperExecutor(HelperClient(helper.socket_path), lambda: arg), NODE)
        with pytest.raises(TerminalError) as exc:
            sec.converge(section(ssh_ca_keys=[K1], principals=[f"alice@{NODE}"]), Observation(), CTX)
        assert exc.value.reason == "access-unsigned"
    finally:
        helper.stop()
    gone = ax.AccessSection(ax.HelperExecutor(HelperClient(str(tmp_path / "none.sock")), lambda: arg), NODE)
    with pytest.raises(HelperRefused):
        gone.converge(section(ssh_ca_keys=[K1]), Observation(), CTX)
