"""Signed intent for the helper's tests: a control plane's keys, trust bundles, join records and signed
DesiredState bodies, built with bcd_shared.pki's own issuance (validity relative to the real clock, since
the helper reads it)."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from bcd_shared import wire
from bcd_shared.joinrecord import write_join_record
from bcd_shared.pki import (
    JoinKeyPin,
    KeyPair,
    Purpose,
    Role,
    TrustBundle,
    issue_intermediate,
    issue_leaf,
    issue_root,
    sign_join_response,
    sign_trust_bundle,
)

HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@attrs.frozen
class Signer:
    key: KeyPair
    chain: tuple[bytes, ...]  # leaf first, without the root


@attrs.frozen
class Hierarchy:
    """A command-signing root with one intermediate CA."""

    root_key: KeyPair
    root: bytes
    ca_key: KeyPair
    ca: bytes

    @classmethod
    def build(cls, name: str) -> Hierarchy:
        t = now()
        root_key, ca_key = KeyPair.generate(), KeyPair.generate()
        root = issue_root(root_key, f"{name} root", t - DAY, t + 365 * DAY, path_length=1)
        ca = issue_intermediate(root, root_key, ca_key.public_key, f"{name} CA", t - DAY, t + 30 * DAY)
        return cls(root_key, root, ca_key, ca)

    def leaf(
        self,
        role: Role = Role.WORKER,
        name: str = "worker-1",
        not_before: dt.datetime | None = None,
        not_after: dt.datetime | None = None,
    ) -> Signer:
        key = KeyPair.generate()
        t = now()
        der = issue_leaf(
            self.ca,
            self.ca_key,
            key.public_key,
            role,
            name,
            not_before or t - HOUR,
            not_after or t + 4 * HOUR,
        )
        return Signer(key, (der, self.ca))


def host_body(
    node_id: str, generation: int, units: dict[str, str] | None, *, patch: bool = False, spec_hash: str = ""
) -> bytes:
    """A serialized DesiredStateBody; `units` None: the spec sets no host section."""
    spec_hash = spec_hash or f"h{generation}"
    host = None
    if units is not None:
        host = wire.HostSection(units=[wire.HostUnit(name=n, settings=s) for n, s in sorted(units.items())])
    if patch:
        return bytes(
            wire.DesiredStateBody(
                node_id=node_id,
                generation=generation,
                spec_hash=spec_hash,
                patch=wire.NodeSpecPatch(host=host),
                base_generation=max(generation - 1, 0),
            )
        )
    return bytes(
        wire.DesiredStateBody(
            node_id=node_id, generation=generation, spec_hash=spec_hash, full=wire.NodeSpec(host=host)
        )
    )


def instances_body(node_id: str, generation: int, *instances: wire.InstanceSpec) -> bytes:
    """A serialized full DesiredStateBody whose instances section holds `instances`."""
    full = wire.NodeSpec(instances=wire.InstancesSection(instances=list(instances)))
    return bytes(
        wire.DesiredStateBody(node_id=node_id, generation=generation, spec_hash=f"h{generation}", full=full)
    )


def settings(**values: Any) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"))


def intent(
    signer: Signer,
    body: bytes,
    *,
    bundle: bytes | None = None,
    with_root: bytes | None = None,
    purpose: Purpose = Purpose.DESIRED_STATE,
    flip: int | None = None,
) -> dict[str, Any]:
    """host.unit's `intent` argument for `body` signed by `signer`."""
    signature = bytearray(signer.key.sign(purpose, body))
    if flip is not None:
        signature[flip % 64] ^= 0x01
    chain = [*signer.chain, *([with_root] if with_root is not None else [])]
    return {
        "body": b64(body),
        "signature": b64(bytes(signature)),
        "chain": [b64(c) for c in chain],
        "trust_bundle": None if bundle is None else b64(bundle),
    }


@attrs.frozen
class ControlPlane:
    """The JoinService key (pinned by root) and the command-signing hierarchies."""

    join_key: KeyPair
    command: Hierarchy
    other: Hierarchy  # never in a bundle: an unknown root

    @classmethod
    def build(cls) -> ControlPlane:
        return cls(KeyPair.generate(), Hierarchy.build("command-signing"), Hierarchy.build("stranger"))

    @property
    def pin(self) -> JoinKeyPin:
        return JoinKeyPin.of_key(self.join_key.public_key)

    def bundle(
        self, version: int, roots: tuple[bytes, ...] | None = None, key: KeyPair | None = None
    ) -> bytes:
        """A serialized SignedTrustBundle (default roots: the command hierarchy's)."""
        tb = TrustBundle(version=version, command_roots=(self.command.root,) if roots is None else roots)
        return bytes(sign_trust_bundle(key or self.join_key, tb))

    def join_response(self, node_id: str, bundle: bytes | None, key: KeyPair | None = None) -> bytes:
        node_key = KeyPair.generate()
        node_ca = Hierarchy.build("nodes")
        cert = issue_leaf(
            node_ca.ca, node_ca.ca_key, node_key.public_key, Role.NODE, node_id, now() - HOUR, now() + DAY
        )
        body = wire.JoinResponseBody(
            node_id=node_id,
            certificate_chain=[cert, node_ca.ca],
            trust_bundle=None if bundle is None else wire.SignedTrustBundle.parse(bundle),
            issued_at=int(now().timestamp() * 1000),
        )
        return sign_join_response(key or self.join_key, body)

    def write_record(self, root: Path, node_id: str, bundle: bytes | None) -> None:
        write_join_record(root, self.join_response(node_id, bundle), self.pin)

    def config_lines(self, *, pin_roots: bool = False) -> str:
        text = f'join_signing_key_pin = "{self.pin}"\n'
        if pin_roots:
            from bcd_shared.pki import root_pin

            text += f'command_root_sha256 = "{root_pin(self.command.root)}"\n'
        return text


def host_unit_doc(unit: str, unit_settings: str | None, intent_arg: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {"unit": unit, "settings": unit_settings, "busy_gpus": []}
    if intent_arg is not None:
        args["intent"] = intent_arg
    return {"op": "host.unit", "args": args}


def intent_state(root: Path) -> dict[str, Any]:
    path = root / "var/lib/bcd-hostconfig/helper-intent.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def devices_spec(node_id: str, generation: int, section: wire.DevicesSection | None) -> bytes:
    """A serialized full DesiredStateBody whose devices section is `section` (None: no section)."""
    return bytes(
        wire.DesiredStateBody(
            node_id=node_id,
            generation=generation,
            spec_hash=f"d{generation}",
            full=wire.NodeSpec(devices=section),
        )
    )


def access_body(
    node_id: str,
    generation: int,
    *,
    ca_keys: tuple[str, ...] = (),
    principals: tuple[str, ...] = (),
    serials: tuple[int, ...] = (),
    jwks: str = "",
    empty: bool = False,
) -> bytes:
    """A serialized full DesiredStateBody whose access section carries these (`empty`: no section)."""
    section = None
    if not empty:
        section = wire.AccessSection(
            exec_ticket_jwks=jwks,
            ssh_ca_keys=list(ca_keys),
            principals=list(principals),
            revoked_serials=list(serials),
        )
    return bytes(
        wire.DesiredStateBody(
            node_id=node_id,
            generation=generation,
            spec_hash=f"a{generation}",
            full=wire.NodeSpec(access=section),
        )
    )


def unsigned(body: bytes) -> dict[str, Any]:
    """An `intent` argument carrying the body without a signature (what a node without roots sends)."""
    return {"body": b64(body), "signature": "", "chain": [], "trust_bundle": None}


def access_doc(intent_arg: dict[str, Any] | None) -> dict[str, Any]:
    return {"op": "access.apply", "args": {} if intent_arg is None else {"intent": intent_arg}}


def hold_text(
    ident: str,
    devices: Sequence[tuple[str, dict[str, Any] | None]],
    env: Sequence[str],
    *,
    generation: int = 1,
    cgroup_parent: str | None = None,
) -> str:
    """A CDI hold spec for `ident`, built as the node's planner builds one: `devices` are (atom id, its
    container edits; None: only its marker)."""
    from bcd_shared import cdi

    doc = cdi.build_hold_spec(
        allocation_id=ident,
        reservation_id="r1",
        generation=generation,
        kubernetes=False,
        cgroup_parent=cgroup_parent,
        devices=[cdi.HoldDevice(atom, edits) for atom, edits in devices],
        env=list(env),
        vendor=None,
    )
    return cdi.encode_spec(doc).decode()
