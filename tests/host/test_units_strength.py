"""Unit rules checked at their edges, so that a loosened rule fails (issue 14's weak checks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bcd_shared.errors import TerminalError
from bcd_shared.units import REGISTRY
from hostunits_support import make_host, plan


def _refused(unit: str, settings: object) -> str:
    with pytest.raises(TerminalError) as exc:
        REGISTRY[unit].decode_settings(json.dumps(settings))
    return exc.value.message


@pytest.mark.parametrize("key", ["a", "A_9", "x" * 64, "nested", "_", "0"])
def test_HST_MOD_07_option_keys_accepted(key: str) -> None:
    """HST-MOD-07: letters, digits and underscores, 1 to 64 of them."""
    REGISTRY["kernel-modules"].decode_settings(json.dumps({"options": {"kvm": f"{key}=1"}}))


@pytest.mark.parametrize("key", ["x" * 65, "x" * 200, "bad-key", "a.b", "é", "a b", "a\tb", "=", "a/b"])
def test_HST_MOD_07_option_keys_refused(key: str) -> None:
    """HST-MOD-07: a key of 65 characters, or with any character outside [A-Za-z0-9_], is refused."""
    message = _refused("kernel-modules", {"options": {"kvm": f"{key}=1"}})
    assert "options.kvm" in message


@pytest.mark.parametrize("value", [0, 1, 2, "0", "1", "2", True, False])
def test_HST_SYS_27_unprivileged_bpf_disabled_refused_whatever_the_value(value: object) -> None:
    """HST-SYS-27: the key is refused outright, not judged by value (1 and 2 would be hardening values
    in a per-value table, and must still be refused)."""
    message = _refused("sysctl", {"kernel.unprivileged_bpf_disabled": value})
    assert "kernel.unprivileged_bpf_disabled is refused" in message


@pytest.mark.parametrize("layout", ["all-1g.10gb", "all-7g.80gb", "all-3g.40gb", "mixed:2x1g.10gb+3g.40gb"])
def test_HST_MIG_08_profiles_accepted(layout: str) -> None:
    REGISTRY["mig-layout"].decode_settings(json.dumps({"layout": layout}))


@pytest.mark.parametrize(
    "profile",
    ["7x.banana", "1g.10", "g.10gb", "1g.gb", "1G.10GB", "1g.10gbx", "1g10gb", "1g.10gb.", "1x.10gb",
     "1g.10mb", "1g.1.0gb", "-1g.10gb", "1g.-10gb", "\uff11g.10gb", "1g.10gb\n", "a1g.10gb"],
)  # fmt: skip
def test_HST_MIG_08_profile_is_n_g_dot_m_gb(profile: str) -> None:
    """HST-MIG-08: a profile is exactly `<n>g.<m>gb` (ASCII digits); anything else is refused."""
    assert "is not a MIG profile" in _refused("mig-layout", {"layout": f"all-{profile}"})


@pytest.mark.parametrize(
    ("isolated", "waits"),
    [
        ("", True),
        ("4-7", False),
        ("4-8", True),
        ("5-7", True),
        ("4-6", True),
        ("4-7\n", False),
        ("4,5,6,7", False),
    ],
)
def test_HST_CPU_17_reboot_until_isolated_shows_exactly_the_list(
    tmp_path: Path, isolated: str, waits: bool
) -> None:
    """HST-CPU-17: RebootRequired until /sys/devices/system/cpu/isolated is exactly the list; a
    different non-empty list (fewer, more, other CPUs) still waits, and its message shows it."""
    root, system = make_host(tmp_path)
    (root / "sys/devices/system/cpu/isolated").write_text(isolated)
    p = plan(system, "cpu", {"isolate": "4-7"})
    reboots = [i.message for i in p.issues if i.kind == "reboot"]
    if waits:
        assert reboots == [
            f'cpu: CPUs 4-7 are isolated from the next boot (now: "{isolated.strip()}"): reboot the node'
        ]
    else:
        assert reboots == []


def test_HST_RBT_06_the_sections_reboot_message_is_cut_to_1024_bytes(tmp_path: Path) -> None:
    """HST-RBT-06: the RebootRequired condition the host section builds carries the waiting units' errors
    cut to at most 1024 bytes on a UTF-8 boundary (the kernel's isolated file is shown in the cpu error,
    here 700 two-byte characters), while the section's own message keeps them whole."""
    from bcd_agent.sections.host import DirectExecutor, HostSection, converge_host
    from bcd_shared.units import ApplyContext, UnitContext
    from hostunits_support import ALLOWED, FakeTokens

    root, system = make_host(tmp_path)
    (root / "sys/devices/system/cpu/isolated").write_text("é" * 700)
    spec = HostSection(
        (("cpu", json.dumps({"isolate": "2-3"})), ("iommu", json.dumps({"passthrough": True})))
    )
    ex = DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))
    out = converge_host(spec, ex)
    [reboot] = [c for c in out.conditions if c.type == "RebootRequired"]
    whole = out.message.encode()
    assert len(whole) > 1024 and out.message.startswith(
        'cpu: CPUs 2-3 are isolated from the next boot (now: "é'
    )
    assert reboot.message.encode() == whole[:1024] or reboot.message.encode() == whole[:1023]
    assert len(reboot.message.encode()) <= 1024
    assert reboot.message.endswith("é")


def test_HST_RBT_06_the_message_is_every_waiting_units_error_not_only_the_first(tmp_path: Path) -> None:
    """HST-RBT-06: under 1024 bytes the RebootRequired message is every waiting unit's error, whole, joined
    by "; " in unit order, and carries no other unit's failure (the sysctl refusal is the section's, not
    the condition's). A condition built from the first waiting unit alone fails here."""
    from bcd_agent.sections.host import DirectExecutor, HostSection, converge_host
    from bcd_shared.units import ApplyContext, UnitContext
    from hostunits_support import ALLOWED, FakeTokens

    root, system = make_host(tmp_path)
    (root / "sys/devices/system/cpu/isolated").write_text("1\n")
    spec = HostSection(
        (
            ("iommu", json.dumps({"passthrough": True})),
            ("sysctl", json.dumps({"kernel.core_pattern": "x"})),
            ("cpu", json.dumps({"isolate": "2-3"})),
        )
    )
    ex = DirectExecutor(system, UnitContext(allowed_clusters=ALLOWED), ApplyContext(tokens=FakeTokens()))
    out = converge_host(spec, ex)
    [reboot] = [c for c in out.conditions if c.type == "RebootRequired"]
    cpu = 'cpu: CPUs 2-3 are isolated from the next boot (now: "1"): reboot the node'
    assert reboot.reason == "cpu,iommu"
    iommu = (
        "iommu: the IOMMU is on from the next boot (intel_iommu=on iommu=pt): reboot the node; "
        "check the firmware enables VT-d or AMD-Vi"
    )
    assert reboot.message == f"{cpu}; {iommu}"
    assert "core_pattern" not in reboot.message
    assert reboot.message in out.message
