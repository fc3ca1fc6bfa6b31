"""Self-update requests for the helper's tests: signed release manifests, the signed spec or daemon.upgrade
command that binds one to freshness, the node's staging directory, and the daemon.swap document."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from bcd_shared import wire
from bcd_shared.pki import Purpose
from bcd_shared.release import ReleaseManifest, sign_release
from helperproc import HelperProcess, base_config
from intentkit import ControlPlane, Signer, b64

NODE_UID = 4242
NODE_ID = "node-a"
LINK = "usr/lib/bcd/bcd"
RECORD = "var/lib/bcd-hostconfig/daemon-release.json"
STAGING = "var/lib/bcd/staging"
OLD_RELEASE = b"#!/bin/sh\necho bcd 1.0.0\n"


def old_release_host(root: Path, cp: ControlPlane, *, node_unit: bool = False) -> HelperProcess:
    """A helper over a host with root's join record, release 1.0.0 installed at LINK and (`node_unit`)
    a bcd-node.service unit file: the starting point of the hostile self-update tests."""
    cp.write_record(root, NODE_ID, cp.bundle(2))
    (root / LINK).parent.mkdir(parents=True, exist_ok=True)
    (root / LINK).write_bytes(OLD_RELEASE)
    (root / LINK).chmod(0o755)
    if node_unit:
        unit = root / "etc/systemd/system/bcd-node.service"
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text("[Service]\nExecStart=/usr/bin/bcd node\n")
    return HelperProcess(root, cp.config_lines() + base_config(node_uid=NODE_UID, node_gid=NODE_UID))


def url(version: str) -> str:
    return f"https://releases.example.com/bcd/{version}/bcd"


def stage(root: Path, name: str, data: bytes, uid: int = NODE_UID) -> str:
    """Put an artifact into the node's staging directory (made node-owned 0700 on the way); its name."""
    for d in (root / "var/lib/bcd", root / STAGING):
        d.mkdir(parents=True, exist_ok=True)
        os.chown(d, NODE_UID, NODE_UID)
        d.chmod(0o700)
    path = root / STAGING / name
    path.write_bytes(data)
    os.chown(path, uid, uid)
    return name


def daemon_section(
    signer: Signer, version: str, data: bytes, *, rollback: bool = False
) -> wire.DaemonSection:
    digest = hashlib.sha256(data).hexdigest()
    manifest = ReleaseManifest(version, url(version), digest, rollback)
    return wire.DaemonSection(
        version=version,
        url=url(version),
        sha256=digest,
        signature=sign_release(signer.key, manifest),
        rollback=rollback,
    )


def spec_carrier(
    signer: Signer, section: wire.DaemonSection | None, generation: int, node: str = NODE_ID
) -> dict[str, str]:
    body = bytes(
        wire.DesiredStateBody(
            node_id=node,
            generation=generation,
            spec_hash=f"h{generation}",
            full=wire.NodeSpec(daemon=section),
        )
    )
    return {"body": b64(body), "signature": b64(signer.key.sign(Purpose.DESIRED_STATE, body))}


def command_carrier(
    signer: Signer,
    section: wire.DaemonSection,
    *,
    command_id: str = "01J0000000000000000000UPG1",
    not_after_ms: int | None = None,
    node: str = NODE_ID,
    kind: str = "daemon.upgrade",
) -> dict[str, str]:
    request = wire.DaemonUpgradeRequest(
        version=section.version,
        url=section.url,
        sha256=section.sha256,
        signature=section.signature,
        rollback=section.rollback,
    )
    from bcd_shared.wire.strict import type_url

    body = bytes(
        wire.CommandBody(
            id=command_id,
            node_id=node,
            seq=1,
            kind=kind,
            payload=wire.ProtoAny(type_url=type_url(wire.DaemonUpgradeRequest), value=bytes(request)),
            lane=wire.Lane.CONTROL,
            not_after=not_after_ms if not_after_ms is not None else int(time.time() * 1000) + 600_000,
            retry_safe=True,
            self_terminating=True,
        )
    )
    return {"body": b64(body), "signature": b64(signer.key.sign(Purpose.COMMAND, body))}


def swap_doc(
    signer: Signer,
    section: wire.DaemonSection,
    artifact: str,
    *,
    spec: dict[str, str] | None = None,
    command: dict[str, str] | None = None,
    timeout: int = 600,
    **override: Any,
) -> dict[str, Any]:
    args: dict[str, Any] = {
        "version": section.version,
        "url": section.url,
        "sha256": section.sha256,
        "signature": b64(section.signature),
        "chain": [b64(c) for c in signer.chain],
        "artifact": artifact,
        "confirm_timeout_s": timeout,
        "rollback": section.rollback,
    }
    if spec is not None:
        args["spec"] = spec
    if command is not None:
        args["command"] = command
    args.update(override)
    return {"op": "daemon.swap", "args": args}


def staged_swap(
    signer: Signer,
    root: Path,
    data: bytes,
    *,
    version: str = "1.1.0",
    generation: int = 1,
    timeout: int = 600,
    rollback: bool = False,
    name: str | None = None,
    **override: Any,
) -> dict[str, Any]:
    """The daemon.swap request for `version` (`data`), carried by the signed spec at `generation`: the
    artifact staged under `root` as the node does (`name`: that artifact name, nothing staged)."""
    section = daemon_section(signer, version, data, rollback=rollback)
    artifact = name if name is not None else stage(root, f"bcd-{version}", data)
    return swap_doc(
        signer, section, artifact, spec=spec_carrier(signer, section, generation), timeout=timeout, **override
    )


def installed(root: Path) -> bytes:
    return (root / LINK).read_bytes()
