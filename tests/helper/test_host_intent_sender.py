"""The node's side of signed intent: data_dir/host-intent.json and the HelperExecutor's sender, against a
real helper. Covers HST-SIGN-02, HST-SIGN-04, HST-HLP-02 (the signed spec rides with every host.unit)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bcd_agent.converge.types import SectionState
from bcd_agent.helperclient import HelperClient
from bcd_agent.sections.host import HelperExecutor, converge_host, section_from_json
from bcd_agent.sections.host.intent import (
    HOST_INTENT_FILE,
    HelperHostSend,
    HostIntent,
    answer_of,
    read_host_intent,
    write_host_intent,
)
from bcd_shared.units import UnitContext
from bcd_simhost import sim_system
from helperproc import HelperProcess, base_config
from intentkit import ControlPlane, host_body, settings

S7 = settings(**{"vm.swappiness": 7})


def test_HST_SIGN_04_host_intent_kept_exactly_0600(tmp_path: Path) -> None:
    assert read_host_intent(tmp_path) is None
    body = host_body("node-a", 4, {"sysctl": S7})
    path = write_host_intent(
        tmp_path, generation=4, body=body, signature=b"s" * 64, signer_chain=(b"c1", b"c2")
    )
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_host_intent(tmp_path) == HostIntent(4, body, b"s" * 64, (b"c1", b"c2"))
    (tmp_path / HOST_INTENT_FILE).write_text('{"generation": 4, "body": "", "signature": ""}')
    with pytest.raises(ValueError, match="keys"):
        read_host_intent(tmp_path)


def test_answer_of_issues() -> None:
    ok = answer_of(
        {"changed": True, "issues": [], "conditions": [{"type": "MPSDown", "reason": "r", "message": "m"}]}
    )
    assert ok.ok and ok.changed and ok.conditions[0].type == "MPSDown"
    bad = answer_of({"changed": False, "issues": [{"kind": "terminal", "message": "x"}]})
    assert not bad.ok and bad.terminal and bad.message == "x"
    reboot = answer_of({"issues": [{"kind": "reboot", "message": "reboot the node"}, {"kind": "terminal"}]})
    assert not reboot.terminal


@pytest.mark.parametrize("pinned", [False, True])
def test_HST_SIGN_02_executor_sends_the_kept_signed_spec(
    fresh_root: Path, tmp_path: Path, pinned: bool
) -> None:
    cp = ControlPlane.build()
    bundle = cp.bundle(2)
    if not pinned:
        cp.write_record(fresh_root, "node-a", bundle)
    h = HelperProcess(fresh_root, cp.config_lines(pin_roots=pinned) + base_config())
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    try:
        send = HelperHostSend(HelperClient(h.socket_path), data_dir, lambda: bundle)
        executor = HelperExecutor(sim_system(fresh_root), send, UnitContext())
        section = section_from_json('[{"name": "sysctl", "settings": {"vm.swappiness": 7}}]')
        # No signed body kept yet: root refuses, the section stays PROGRESSING (retryable).
        out = converge_host(section, executor)
        assert out.state is SectionState.PROGRESSING and "a signed spec is required" in out.message
        worker = cp.command.leaf()
        body = host_body("node-a", 9, {"sysctl": S7})
        from bcd_shared.pki import Purpose

        write_host_intent(
            data_dir,
            generation=9,
            body=body,
            signature=worker.key.sign(Purpose.DESIRED_STATE, body),
            signer_chain=worker.chain,
        )
        out = converge_host(section, executor)
        assert out.state is SectionState.CONVERGED, out.message
        assert "vm.swappiness = 7" in (fresh_root / "etc/sysctl.d/90-bcd.conf").read_text()
        assert h.last_audit()["decision"] == "accepted"
    finally:
        h.stop()
