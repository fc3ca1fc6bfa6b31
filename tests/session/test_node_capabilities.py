"""Hello's hold capabilities follow whether the node can act on the host."""

from __future__ import annotations

from bcd_agent.node import acts_on_host, device_capabilities


def test_DEV_UNPRIV_01_02_an_unprivileged_node_without_a_helper_advertises_no_holds() -> None:
    """Covers DEV-UNPRIV-01, DEV-UNPRIV-02: uid other than 0, no [helper] socket, the real host."""
    assert acts_on_host(None, 990, "/") is False
    assert device_capabilities(True, acts_on_host(None, 990, "/")) == ()


def test_DEV_CAP_01_a_node_that_can_bind_advertises_cdi_limits_and_kubernetes() -> None:
    """Covers DEV-CAP-01, DLV-DEV-47: through the helper, as root, or on a simulated host."""
    for helper, euid, root in (("/run/bcd/helper.sock", 990, "/"), (None, 0, "/"), (None, 990, "/tmp/sim")):
        assert acts_on_host(helper, euid, root) is True
        assert device_capabilities(True, True) == ("cdi", "devices.limits", "binding.kubernetes")
    assert device_capabilities(False, True) == ()  # a build without the devices section
