"""The instances section with network policy: which NIC policies are loaded, when, and what a policy that
cannot be expressed or rules that fail to load do to the instances (the simulated host's libvirt; the
rules themselves run for real in test_netpolicy_real.py, so the backend here records what it was given).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bcd_agent.converge.types import SectionState
from bcd_agent.sections.instances.model import Desired, Nic
from bcd_agent.sections.instances.network import NETWORK_WAIT, NetworkPolicy, nic_policies
from bcd_agent.sections.instances.runtimes.base import RUNNING, STOPPED
from bcd_agent.sections.instances.section import InstancesSection, capabilities
from bcd_shared.errors import RetryableError
from bcd_shared.netpolicy import NicPolicy
from instkit import converge, section, sim_host, spec, vm


class Recording:
    """An NftBackend that records each load (and the runtime's domains at that moment)."""

    def __init__(self, sec: InstancesSection | None = None) -> None:
        self.loads: list[list[NicPolicy]] = []
        self.running_at_load: list[set[str]] = []
        self.fail = False
        self.sec = sec

    def load(self, nics: Sequence[NicPolicy]) -> None:
        if self.sec is not None:
            views = self.sec.list_runtimes()
            self.running_at_load.append(
                {d.name for v in views.values() for d in v.domains if d.state == RUNNING}
            )
        if self.fail:
            raise RetryableError("nft", "nft -f: Error: Could not process rule")
        self.loads.append(list(nics))

    def check(self) -> bool:
        return True


def nic(n: int, policy_addr: str) -> tuple[Nic, ...]:
    return (Nic("br0", f"52:54:00:00:00:{n:02x}", (policy_addr,)),)


def _sec(tmp_path: Path) -> tuple[InstancesSection, Recording]:
    sec, _rt = section(sim_host(tmp_path))
    rec = Recording(sec)
    sec.network = NetworkPolicy(rec)
    return sec, rec


def test_rules_loaded_before_any_domain_starts_dlv_nft_01(tmp_path: Path) -> None:
    """DLV-NFT-01, DLV-NFT-07: the first load happens while no domain runs yet, and names each NIC's tap
    (the runtime's tap_name) before the tap exists."""
    sec, rec = _sec(tmp_path)
    out = converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24"), network_policy="PRIVATE")))
    assert out.state is SectionState.CONVERGED, out.message
    assert rec.running_at_load[0] == set()
    assert [(n.instance, n.tap, n.policy) for n in rec.loads[0]] == [("a", "bcca978112ca10", "PRIVATE")]
    assert [i.state for i in sec.last_report.instances] == ["RUNNING"]
    converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24"), network_policy="PRIVATE"), generation=2))
    assert len(rec.loads) == 1  # unchanged and intact: not loaded again


def test_policy_that_cannot_be_expressed_fails_and_stops_dlv_nft_05(tmp_path: Path) -> None:
    """DLV-NFT-05: a PRIVATE NIC without IPAM addresses fails its instance, which stops if it runs; the
    other instance keeps its rules and runs."""
    sec, rec = _sec(tmp_path)
    converge(
        sec, spec(vm("a", nics=nic(1, "10.0.0.5/24")), vm("b", nics=nic(2, "10.0.0.6/24")), generation=1)
    )
    bare = (Nic("br0", "52:54:00:00:00:01"),)
    out = converge(
        sec,
        spec(vm("a", nics=bare, network_policy="PRIVATE"), vm("b", nics=nic(2, "10.0.0.6/24")), generation=2),
    )
    states = {i.instance_id: (i.state, i.message) for i in sec.last_report.instances}
    assert states["a"][0] == "ERROR" and "needs a MAC and IPAM addresses" in states["a"][1], states
    assert states["b"][0] == "RUNNING"
    assert out.state is SectionState.FAILED
    assert {n.instance for n in rec.loads[-1]} == {"b"}
    views = sec.list_runtimes()
    assert {d.name: d.state for v in views.values() for d in v.domains}["a"] == STOPPED
    assert sec.last_plan is not None and any(
        type(s).__name__ == "Stop" and s.name == "a" for s in sec.last_plan.steps
    )


def test_failed_load_stops_guarded_and_keeps_egress_dlv_nft_06_27(tmp_path: Path) -> None:
    """DLV-NFT-06, DLV-NFT-27: rules that fail to load fail and stop the PRIVATE instance; the EGRESS one
    keeps running, the section stays PROGRESSING and the next pass loads them."""
    sec, rec = _sec(tmp_path)
    both = spec(
        vm("a", nics=nic(1, "10.0.0.5/24"), network_policy="PRIVATE"),
        vm("e", nics=nic(2, "10.0.0.6/24")),
    )
    converge(sec, both)
    rec.fail = True
    sec.network.needs_reload = True  # type: ignore[union-attr]
    out = converge(sec, both)
    assert out.state is SectionState.PROGRESSING and NETWORK_WAIT in out.message
    states = {i.instance_id: (i.state, i.message) for i in sec.last_report.instances}
    assert states["a"][0] == "ERROR" and "network rules failed to load" in states["a"][1]
    assert states["e"][0] == "RUNNING"
    assert sec.last_plan is not None and [
        s.name for s in sec.last_plan.steps if type(s).__name__ == "Stop"
    ] == ["a"]
    rec.fail = False
    out = converge(sec, both)
    assert out.state is SectionState.CONVERGED, out.message
    assert {i.instance_id: i.state for i in sec.last_report.instances} == {"a": "RUNNING", "e": "RUNNING"}


def test_ssh_from_host_only_is_guarded_dlv_nft_28() -> None:
    """DLV-NFT-28: an EGRESS instance with ssh_from_host_only counts as guarded (a failed load stops it)."""
    from bcd_agent.sections.instances.network import guards

    assert guards("EGRESS", True) and guards("NONE", False) and guards("PRIVATE", False)
    assert not guards("EGRESS", False)


def test_deleted_instance_keeps_its_guard_until_its_domain_is_gone_dlv_nft_17() -> None:
    """DLV-NFT-17: an instance the spec dropped keeps its last NIC policies while its domain exists."""
    old = (NicPolicy("gone", 0, "br0", "52:54:00:00:00:09", ("10.0.0.9/24",), "EGRESS"),)
    s = spec(vm("a", nics=nic(1, "10.0.0.5/24")), vm("gone", desired=Desired.DELETED, nics=old_nics()))
    kept, errors = nic_policies(s, ["a", "gone"], {"gone": old})
    assert kept["gone"] == old and not errors
    kept, _ = nic_policies(s, ["a"], {"gone": old})
    assert "gone" not in kept


def old_nics() -> tuple[Nic, ...]:
    return (Nic("br0", "52:54:00:00:00:09", ("10.0.0.9/24",)),)


def test_an_address_two_instances_claim_is_bound_once_dlv_nft_18() -> None:
    """DLV-NFT-18: the second instance claiming an address fails; only the first is bound (and a
    deleted instance's kept guard yields to nobody: its address stays its own)."""
    s = spec(vm("a", nics=nic(1, "10.0.0.5/24")), vm("b", nics=nic(2, "10.0.0.5/24")))
    kept, errors = nic_policies(s, [], {})
    assert set(kept) == {"a"} and "claimed by instance a" in errors["b"]


def test_instances_whose_tap_names_collide_one_is_guarded_the_other_fails_alone() -> None:
    """`vm-1762438` and `vm-3742940` share every tap name; one load with both would be refused whole
    (netpolicy), leaving every instance unguarded. The first in the spec keeps its rules and the twin
    fails alone naming both; one whose domain exists keeps them whatever the order; a dropped
    instance's kept guard keeps them from a new twin; a twin without NICs has no taps."""
    a, b = "vm-1762438", "vm-3742940"
    s = spec(
        vm(a, nics=nic(1, "10.0.0.5/24")),
        vm(b, nics=nic(2, "10.0.0.6/24")),
        vm("c", nics=nic(3, "10.0.0.7/24")),
    )
    kept, errors = nic_policies(s, [], {})
    assert set(kept) == {a, "c"} and set(errors) == {b}
    assert (
        errors[b].startswith(f"network policy: nics: instance {b}'s taps")
        and f"are instance {a}'s too" in errors[b]
    )
    kept, errors = nic_policies(s, [b], {})
    assert set(kept) == {b, "c"} and f"are instance {b}'s too" in errors[a]
    old = (NicPolicy(a, 0, "br0", "52:54:00:00:00:09", ("10.0.0.9/24",), "EGRESS"),)
    kept, errors = nic_policies(spec(vm(b, nics=nic(2, "10.0.0.6/24"))), [a], {a: old})
    assert kept == {a: old} and f"are instance {a}'s too" in errors[b]
    kept, errors = nic_policies(spec(vm(a, nics=nic(1, "10.0.0.5/24")), vm(b, nics=())), [], {})
    assert set(kept) == {a, b} and not errors
    kept, errors = nic_policies(spec(vm(a, nics=()), vm(b, nics=nic(2, "10.0.0.6/24"))), [], {})
    assert set(kept) == {a, b} and not errors
    # A DELETED twin (no domain left) holds nothing, and the instances after it are still looked at.
    gone = vm(a, desired=Desired.DELETED, nics=nic(1, "10.0.0.5/24"))
    kept, errors = nic_policies(spec(gone, vm(b, nics=nic(2, "10.0.0.6/24"))), [], {})
    assert set(kept) == {b} and not errors


def test_unset_policy_fails() -> None:
    s = spec(vm("a", nics=nic(1, "10.0.0.5/24"), network_policy="UNSPECIFIED"))
    kept, errors = nic_policies(s, [], {})
    assert not kept and "network_policy" in errors["a"]


def test_capabilities_only_what_is_enforced_dlv_cap_05() -> None:
    """DLV-CAP-01, DLV-CAP-02, DLV-CAP-05: network policy and SSH from the host only are advertised only
    where the rules are loaded."""
    assert "instance.network-policy" not in capabilities(["libvirt-kvm"])
    caps = capabilities(["libvirt-kvm"], network=True)
    assert "instance.network-policy" in caps and "instance.ssh-host-only" in caps
    assert capabilities([], network=True) == ()


def test_guard_kept_while_the_runtime_cannot_be_listed_dlv_nft_17(tmp_path: Path) -> None:
    """DLV-NFT-17: an instance the spec dropped keeps its guard while its runtime cannot be listed (its
    domain may still run); the guard goes once the domain is seen gone."""
    sec, rec = _sec(tmp_path)
    converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24")), vm("b", nics=nic(2, "10.0.0.6/24"))))
    rt = sec.runtimes["libvirt-kvm"]
    real_list = rt.list

    def broken() -> tuple[object, ...]:
        raise RetryableError("ListFailed", "virsh list: error: failed to connect to the hypervisor")

    rt.list = broken  # type: ignore[method-assign]
    converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24")), generation=2))
    assert {n.instance for n in rec.loads[-1]} == {"a", "b"}
    rt.list = real_list  # type: ignore[method-assign]
    converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24")), generation=3))  # b's domain deleted
    converge(sec, spec(vm("a", nics=nic(1, "10.0.0.5/24")), generation=4))
    assert {n.instance for n in rec.loads[-1]} == {"a"}
