"""`bcd node`'s instances part: which runtimes this host runs, how they act, and the user data source.

- The simulated host (`--root DIR`): libvirt-kvm over the simulated host's fake virsh (DLV-RT-16).
- A real host: libvirt-kvm when `virsh` is on PATH (DLV-RT-01/02), acting directly as root
  (`virsh -c qemu:///system`) or, with `[helper] socket`, through the helper's libvirt.* operations
  (reads with `virsh -r`), carrying the signed spec the node keeps (host-intent.json: the newest full
  spec, which sets the instances section too) so root can re-validate. An unprivileged node without
  a helper runs no instance runtime (it is not in the libvirt group, DLV-HLP-01).
- cloud-hypervisor (issue 12) under the helper, where `ch_available` finds its binary at v51 or
  later, /dev/kvm and the helper's ch.* operations (then Hello advertises it), or as root without a
  helper, its root steps in process (runtimes/chlocal.py); see docs/instances.md.
- User data: a SecretRequest bound to the instance's allocation (DLV-INST-06), from the runner's
  worker thread; a refusal fails the instance, no answer keeps it waiting.
- Off the pass, in the node's nursery, each in a worker thread: the identity rebind every 10 s
  (`rebind_periodically`, only when the spec asks for a rebind or rebind state is kept; the bundle
  fetched like user data, DLV-REB-02/04; a success triggers a pass, whose report carries
  `identity_rebound_ref`) and the balloon controller every 30 s
  (`balloon_periodically`, DLV-BAL-03).
"""

from __future__ import annotations

import base64
import logging
import os
import shutil
from collections.abc import Callable
from functools import partial
from typing import Any

import trio
from attrs import frozen
from bcd_shared.errors import RetryableError, TerminalError

from bcd_agent.sections.instances.plan import UserData

log = logging.getLogger("bcd.instances")


class SessionUserData:
    def __init__(self, requests: Any, trio_token: trio.lowlevel.TrioToken) -> None:
        self._requests = requests
        self._token = trio_token

    def fetch(self, instance_id: str, allocation_id: str, ref: str) -> UserData:
        try:
            value = trio.from_thread.run(
                partial(self._requests.fetch, ref, allocation_id=allocation_id, instance_id=instance_id),
                trio_token=self._token,
            )
        except TerminalError as exc:
            return UserData(refused=exc.message)
        except RetryableError as exc:
            return UserData(unavailable=exc.message)
        return UserData(data=bytes(value))


def helper_intent(data_dir: str) -> dict[str, Any]:
    """The signed spec the node keeps, as libvirt.define/start's `intent` ({} when none is kept)."""
    from bcd_agent.sections.host.intent import read_host_intent

    try:
        kept = read_host_intent(data_dir)
    except (ValueError, OSError) as exc:
        log.warning("instances: the kept signed spec cannot be read: %s", exc)
        return {}
    if kept is None:
        return {}
    return {
        "body": base64.b64encode(kept.body).decode(),
        "signature": base64.b64encode(kept.signature).decode(),
        "chain": [base64.b64encode(c).decode() for c in kept.signer_chain],
    }


def build_runtimes(
    system: Any,
    data_dir: str,
    *,
    simulated: bool,
    helper: Any,
    as_root: bool,
    intent_dir: str = "",
    host: HostTools | None = None,
) -> list[Any]:
    """The runtimes this host runs (DLV-RT-01..04). `host`: how PATH, /dev/kvm and the VMM's version
    are read (this machine's by default)."""
    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, HelperVirsh, LibvirtRuntime
    from bcd_agent.sections.instances.section import runtimes_on_path

    tools = host or HostTools()
    out: list[Any] = []
    if helper is not None and not simulated:
        out.extend(_cloud_hypervisor(system, data_dir, helper, intent_dir, tools))
    elif as_root and not simulated:
        # As root without the helper, cloud-hypervisor's root steps run in process (chlocal.py).
        from bcd_agent.sections.instances.runtimes.chlocal import LocalChOps

        ops = LocalChOps(system, data_dir, which=tools.which)
        out.extend(_cloud_hypervisor(system, data_dir, ops, intent_dir, tools))
    if not simulated and not runtimes_on_path(tools.which):
        return out
    if helper is not None:
        virsh: Any = HelperVirsh(system, helper, intent=lambda: helper_intent(intent_dir or data_dir))
        return [LibvirtRuntime(system, virsh, data_dir, under_helper=True), *out]
    if simulated or as_root:
        return [LibvirtRuntime(system, DirectVirsh(system), data_dir), *out]
    log.warning(
        "instances: unprivileged without [helper] socket: this node runs no instance runtime; set "
        "[helper] socket in config.toml (deploy/install.sh writes it) beside a root bcd helper"
    )
    return []


@frozen
class HostTools:
    """What decides which runtimes run: PATH lookups, whether /dev/kvm exists, a VMM's version."""

    which: Callable[[str], str | None] = shutil.which
    kvm: Callable[[], bool] = lambda: os.path.exists("/dev/kvm")
    version_of: Callable[[str], str | None] | None = None


def _cloud_hypervisor(
    system: Any, data_dir: str, helper: Any, intent_dir: str, tools: HostTools
) -> list[Any]:
    from bcd_agent.sections.instances.runtimes.cloudhypervisor import (
        CloudHypervisorRuntime,
        ch_available,
        vmm_version,
    )

    why = ch_available(tools.which, tools.kvm(), helper, tools.version_of or vmm_version)
    if why is not None:
        log.info("instances: cloud-hypervisor is not run: %s", why)
        return []
    intent = partial(helper_intent, intent_dir or data_dir)
    return [CloudHypervisorRuntime(system, helper, data_dir, intent=intent)]


REBIND_INTERVAL_S = 10.0


def off_pass_parts(section: Any, system: Any, data_dir: str, floor_percent: int) -> None:
    """Give the section its rebinder (over the same SecretRequest source as user data) and balloon
    controller."""
    from bcd_agent.sections.instances.balloon import BalloonController
    from bcd_agent.sections.instances.rebind import Rebinder

    section.rebinder = Rebinder(system, data_dir, section.runtimes, section.user_data)
    section.balloons = BalloonController(system, section.runtimes, floor_percent)


async def rebind_periodically(
    section: Any, desired: Any, trigger: Any, interval_s: float = REBIND_INTERVAL_S
) -> None:
    while True:
        await trio.sleep(interval_s)
        try:
            payload = desired()
            if not section.rebind_due(payload):  # nothing to rebind: no worker thread
                continue
            done = await trio.to_thread.run_sync(section.rebind_tick, payload)
        except Exception:  # never ends the node; the next tick tries again
            log.warning("instances: the identity rebind failed", exc_info=True)
            continue
        if any(outcome == "rebound" for _i, outcome in done):
            trigger("identity rebound")


async def balloon_periodically(section: Any, desired: Any, interval_s: float | None = None) -> None:
    from bcd_agent.sections.instances.balloon import INTERVAL_S

    while True:
        await trio.sleep(INTERVAL_S if interval_s is None else interval_s)
        try:
            await trio.to_thread.run_sync(section.balloon_tick, desired())
        except Exception:  # never ends the node
            log.warning("instances: the balloon controller failed", exc_info=True)
