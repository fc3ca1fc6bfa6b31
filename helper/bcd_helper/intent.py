"""Signed intent: root applies a host unit only when a spec the control plane signed asks for it.

host-config.md "Signed specs" (HST-SIGN-01..33). Imported on the first request that needs it (it pulls
bcd_shared.pki, the wire types and cryptography, ~100 ms), never at the helper's start.

Where the command-signing roots come from, in this order:
1. `command_root_sha256` in root's config.toml: the pins decide alone. The request names its root as the
   last certificate of the chain it sends (the node appends it from its trust bundle), and that root must
   be pinned (HST-SIGN-06). Trust bundles the node presents are ignored.
2. Root's join record `/var/lib/bcd-hostconfig/join-response.pb`, re-verified against root's
   `join_signing_key_pin` (HST-SIGN-07/20/21): its trust bundle's command roots. A record the pinned key
   did not sign (or one that cannot be read under the root-only rule) refuses every request.
3. A SignedTrustBundle the node presents, verified against `join_signing_key_pin`, forward only from the
   newest version accepted, the record's included (HST-SIGN-09/10/15/16). Once a presented bundle moved
   the version past the record's, a request without it is refused (HST-SIGN-17).
With `join_signing_key_pin` set but no join record, a request that brings no roots (no presented bundle
with command roots) is refused (`join-record-required`): a pin means signing is expected, so stripping the
signature never falls back to the unsigned rules (issue 9, item 9).
From the first bundle with command roots on (`signed` in the state), a request without a signed spec, or
presenting a bundle without roots, is refused whatever the node sends (HST-SIGN-08/28/29). Where nothing
names roots, nothing is checked (HST-SIGN-33).

With roots, the signed spec must: verify as a `desired-state` signature of a worker certificate chained to
the roots (HST-SIGN-18) at the current time, or, for a body whose digest the helper already verified at
the newest generation, at the time it was first verified (HST-SIGN-30/31); decode strictly (a full spec
decides the host section, unset meaning no units; a patch must set it); name the node
of root's join record, or without a record the node fixed by the first signed spec accepted (trust on
first use, HST-SIGN-19/20/23); have a generation not older than the newest accepted (HST-SIGN-24); set
the host section; name the unit with byte-identical settings (HST-SIGN-25, Q-HST-SIGN-03: canonical JSON
text compared exactly), or, for a clean, not name it (HST-SIGN-26).

Root's state is `/var/lib/bcd-hostconfig/helper-intent.json` (0600, root-only rule, atomic, fsynced):
{"format": 1, "record_sha256", "node_id", "node_source", "generation", "bundle_version",
"bundle_sha256", "signed", "verified": [{"sha256", "generation", "verified_at_ms"}]}. A new join record
(a re-join as root) resets it to the record: the binding moves and generations start over (HST-SIGN-22);
a record naming the node already bound keeps the generation floor (a re-join keeping the node id).
The checks are pure over (state, record, request, now): `check_host_unit` returns the next state, and
the caller writes it only once the request passed every other rule, before the effect.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from attrs import frozen
from bcd_shared.joinrecord import JOIN_RECORD
from bcd_shared.pki import (
    ChainCache,
    JoinKeyPin,
    PkiError,
    Roots,
    TrustStore,
    VerifiedBundle,
    VerifiedJoin,
    parse_certificate,
    verify_desired_state,
    verify_join_response,
    verify_signed_trust_bundle,
)
from bcd_shared.rootpath import RootPathRefused, read_root_only, write_root_only
from bcd_shared.wire.strict import WireError, decode_spec_body

from bcd_helper.config import HelperConfig
from bcd_helper.ops.base import Failed, Refused
from bcd_helper.usedcommands import UsedCommands

STATE_PATH: Final = "/var/lib/bcd-hostconfig/helper-intent.json"
STATE_FORMAT: Final = 1
MAX_VERIFIED: Final = 16
MAX_STATE: Final = 256 * 1024
MAX_CACHED_BUNDLES: Final = 8


# The fields an unverified spec body may decode to (`[helper] unsigned_access`, development only; round 6b):
# counted by the strict walk before anything is built. A spec of a few hundred assignments, instances and
# access entries has a few thousand; an empty submessage is two bytes on the wire and ~300 once decoded.
MAX_UNSIGNED_FIELDS: Final = 65536

# InstanceDesiredState (nodespec.proto): the states in which the guest runs (PAUSED: started paused, its
# memory and devices taken), and the names a refusal shows.
RUNNING = 1
RUNS = frozenset({RUNNING, 2})
DESIRED_NAMES = {0: "UNSPECIFIED", 1: "RUNNING", 2: "PAUSED", 3: "STOPPED", 4: "DELETED"}


@frozen
class Verified:
    """A body the helper verified: its SHA-256, its generation and when it was first verified."""

    sha256: str
    generation: int
    verified_at_ms: int


@frozen
class IntentState:
    record_sha256: str = ""  # the join record this state belongs to ("" without a record)
    node_id: str = ""  # the node whose specs are accepted ("" not bound yet)
    node_source: str = ""  # "record" | "first-signed-spec" | ""
    generation: int = 0  # the newest generation accepted
    bundle_version: int = 0  # the newest trust bundle version accepted (the record's included)
    bundle_sha256: str = ""
    signed: bool = False  # a bundle with command roots was accepted: signed intent is on for good
    verified: tuple[Verified, ...] = ()  # bodies verified at `generation`

    def encode(self) -> bytes:
        doc = {"format": STATE_FORMAT, **attrs.asdict(self, recurse=True)}
        doc["verified"] = [attrs.asdict(v) for v in self.verified]
        return (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> IntentState:
        """Strict: exact keys and JSON types; raises ValueError naming the field."""
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        want = {"format", *attrs.fields_dict(cls)}
        if set(doc) != want:
            raise ValueError(f"keys {sorted(doc)} are not {sorted(want)}")
        if doc["format"] != STATE_FORMAT:
            raise ValueError(f"format {doc['format']!r} is not {STATE_FORMAT}")
        types: dict[str, type] = {
            "record_sha256": str,
            "node_id": str,
            "node_source": str,
            "generation": int,
            "bundle_version": int,
            "bundle_sha256": str,
            "signed": bool,
            "verified": list,
        }
        for key, kind in types.items():
            if type(doc[key]) is not kind:
                raise ValueError(f"{key}: expected {kind.__name__}")
        verified = []
        for i, item in enumerate(doc["verified"]):
            if (
                not isinstance(item, dict)
                or set(item) != {"sha256", "generation", "verified_at_ms"}
                or type(item["sha256"]) is not str
                or type(item["generation"]) is not int
                or type(item["verified_at_ms"]) is not int
            ):
                raise ValueError(f"verified[{i}]: expected {{sha256, generation, verified_at_ms}}")
            verified.append(Verified(item["sha256"], item["generation"], item["verified_at_ms"]))
        return cls(
            record_sha256=doc["record_sha256"],
            node_id=doc["node_id"],
            node_source=doc["node_source"],
            generation=doc["generation"],
            bundle_version=doc["bundle_version"],
            bundle_sha256=doc["bundle_sha256"],
            signed=doc["signed"],
            verified=tuple(verified),
        )


@frozen
class SpecCheck:
    """A spec that passed the common rules: the decoded body (verified when `roots`), the state to write."""

    decoded: Any | None  # a DesiredStateBody
    next_state: IntentState | None
    roots: bool  # command-signing roots were found and the body verified against them
    source: str


@frozen
class TrustView:
    """The roots a request is checked against (None: nothing names roots, HST-SIGN-33) and the state
    after the request's trust bundle (not written yet)."""

    roots: Roots | None
    state: IntentState
    source: str  # "command_root_sha256" | "join record" | "trust bundle" | "none"


def _b64(value: str, field: str, op: str) -> bytes:
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise Refused("bad-intent", f"{op}: intent.{field} is not base64") from None


def _is_self_issued(der: bytes) -> bool:
    try:
        cert = parse_certificate(der).cert
    except PkiError:
        return False
    return bool(cert.subject == cert.issuer)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _ms(when: dt.datetime) -> int:
    return int(when.timestamp() * 1000)


class IntentVerifier:
    """Root's signed-intent checks for one helper process: caches (chains, the record, bundles) and the
    state file. Callers serialise the read-check-write of the state (host.unit holds the `units` lock)."""

    def __init__(self, root: Path, config: HelperConfig) -> None:
        self.root = root
        self.config = config
        self.chains = ChainCache()
        self._record: tuple[str, VerifiedJoin] | None = None
        self._bundles: dict[str, VerifiedBundle] = {}
        self._lock = threading.Lock()  # guards the caches
        self._save_lock = threading.Lock()  # one state write at a time
        self.used = UsedCommands(root)  # the destructive commands acted on (gpu.reset, node.reboot)

    # --- root's files -----------------------------------------------------------------------------

    def load_state(self, op: str) -> IntentState:
        try:
            data = read_root_only(self.root, STATE_PATH, MAX_STATE)
        except RootPathRefused as exc:
            raise Failed("intent-state", f"{op}: {STATE_PATH}: {exc}") from None
        if data is None:
            return IntentState()
        try:
            return IntentState.decode(data)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise Failed("intent-state", f"{op}: {STATE_PATH} cannot be read: {exc}") from None

    def save_state(self, state: IntentState) -> None:
        """Write the state, never moving the generation back: two ops that check specs under different
        locks (host.unit, access.apply) may race, and the newer accepted generation wins."""
        with self._save_lock:
            current = self.load_state("intent")
            if current.record_sha256 == state.record_sha256 and current.generation > state.generation:
                return
            try:
                write_root_only(self.root, STATE_PATH, state.encode(), 0o600)
            except RootPathRefused as exc:
                raise Failed("intent-state", f"{STATE_PATH}: {exc}") from None

    def _pin(self, what: str, op: str) -> JoinKeyPin:
        if self.config.join_signing_key_pin is None:
            raise Refused(
                "intent-unverifiable",
                f"{op}: {what} cannot be verified: root's config.toml has no join_signing_key_pin",
            )
        return JoinKeyPin(self.config.join_signing_key_pin)

    def join_record(self, op: str) -> VerifiedJoin | None:
        """Root's join record, re-verified against the pin (cached by its digest); None without one."""
        try:
            data = read_root_only(self.root, JOIN_RECORD, 1024 * 1024)
        except RootPathRefused as exc:
            raise Refused("join-record", f"{op}: root's join record {JOIN_RECORD}: {exc}") from None
        if data is None:
            return None
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            if self._record is not None and self._record[0] == digest:
                return self._record[1]
        pin = self._pin(f"root's join record {JOIN_RECORD}", op)
        try:
            verified = verify_join_response(data, pin)
        except PkiError as exc:
            raise Refused(
                "join-record",
                f"{op}: root's join record {JOIN_RECORD} is refused ({exc}): no host change is applied",
            ) from None
        with self._lock:
            self._record = (digest, verified)
        return verified

    def _bundle(self, data: bytes, op: str) -> VerifiedBundle:
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            found = self._bundles.get(digest)
        if found is not None:
            return found
        pin = self._pin("the presented trust bundle", op)
        try:
            verified = verify_signed_trust_bundle(data, pin)
        except PkiError as exc:
            raise Refused("untrusted-bundle", f"{op}: the presented trust bundle is refused: {exc}") from None
        with self._lock:
            if len(self._bundles) >= MAX_CACHED_BUNDLES:
                self._bundles.pop(next(iter(self._bundles)))
            self._bundles[digest] = verified
        return verified

    # --- the roots ----------------------------------------------------------------------------------

    def trust(
        self, op: str, presented: bytes | None, chain: Sequence[bytes], state: IntentState | None = None
    ) -> TrustView:
        """The roots this request is checked against, and the state after its bundle (see the module)."""
        state = self.load_state(op) if state is None else state
        record = self.join_record(op)
        record_bundle = record.trust_bundle if record is not None else None
        if record is not None:
            digest = hashlib.sha256(record.body_bytes).hexdigest()
            if state.record_sha256 != digest:  # a new join as root: the binding moves (HST-SIGN-22)
                # Joined again as the same node (a tpm or provisioned re-join keeps the id, and the control
                # plane its generation): the floor stays, else older signed specs replay (round 6). Only
                # another node's specs start over.
                same = bool(state.node_id) and state.node_id == record.node_id
                state = IntentState(
                    record_sha256=digest,
                    node_id=record.node_id,
                    node_source="record",
                    generation=state.generation if same else 0,
                    bundle_version=record_bundle.version if record_bundle else 0,
                    bundle_sha256=record_bundle.sha256 if record_bundle else "",
                    signed=bool(record_bundle and record_bundle.bundle.has_command_roots)
                    or (same and state.signed),
                    verified=state.verified if same else (),
                )
        elif state.record_sha256:
            raise Refused(
                "join-record",
                f"{op}: root's join record {JOIN_RECORD} is gone, but this helper was bound to it",
            )
        pins = self.config.command_root_sha256
        if pins:
            if not chain:
                raise Refused(
                    "intent-required", f"{op}: command_root_sha256 pins the roots: a signed spec is required"
                )
            named = [chain[-1]] if _is_self_issued(chain[-1]) else []
            if not named:
                raise Refused(
                    "intent-unverifiable",
                    f"{op}: command_root_sha256 pins the roots: "
                    "the signed spec's chain must end with its root",
                )
            try:
                roots = Roots.pinned(named, pins)
            except PkiError as exc:
                raise Refused("bad-intent", f"{op}: the signed spec is refused: {exc}") from None
            return TrustView(roots, attrs.evolve(state, signed=True), "command_root_sha256")
        current = record_bundle
        source = "join record"
        if presented is not None:
            bundle = self._bundle(presented, op)
            try:
                store = TrustStore(state.bundle_version, state.bundle_sha256).accept(bundle)
            except PkiError as exc:
                raise Refused("stale-bundle", f"{op}: the presented trust bundle is refused: {exc}") from None
            state = attrs.evolve(state, bundle_version=store.version, bundle_sha256=store.sha256)
            current, source = bundle, "trust bundle"
        elif state.bundle_version > (record_bundle.version if record_bundle else 0):
            raise Refused(
                "bundle-required",
                f"{op}: trust bundle version {state.bundle_version} rotated the command-signing roots: "
                "the node must present it",
            )
        if current is not None and current.bundle.has_command_roots:
            return TrustView(current.bundle.command_root_set(), attrs.evolve(state, signed=True), source)
        if state.signed:
            if presented is not None:
                raise Refused(
                    "rootless-bundle",
                    f"{op}: the presented trust bundle has no command-signing roots, "
                    "and this node's specs are signed",
                )
            raise Refused("intent-required", f"{op}: this node's specs are signed: a signed spec is required")
        if self.config.join_signing_key_pin is not None and record is None:
            # A pin means the control plane signs: until root's join record exists, there are no roots to
            # check against, and an unsigned request is refused rather than applied (issue 9, item 9).
            raise Refused(
                "join-record-required",
                f"{op}: root's config.toml pins the JoinService key (join_signing_key_pin) but root's join "
                f"record {JOIN_RECORD} does not exist yet: nothing is applied until `bcd join` writes it",
            )
        return TrustView(None, state, "none")

    # --- libvirt.* -------------------------------------------------------------------------------------

    def signed_instance(
        self,
        op: str,
        instance_id: str,
        intent: Any | None,
        now: dt.datetime | None = None,
        *,
        starts: bool = False,
        resumes: bool = False,
        unpaused: bool = False,
        runtime: str | None = None,
    ) -> tuple[Any | None, IntentState | None]:
        """The signed spec's InstanceSpec for `instance_id` (None: nothing names roots, nothing is
        checked, DLV-HLP re-validation off) and the state to write. Raises Refused like host.unit (the
        common rules of check_spec), or `not-in-spec` for a spec that does not name the instance (or
        wants it DELETED). `starts` (an op that runs the guest: a start, a restore, a VMM launch and its
        VFIO groups): `instance-stopped` unless the spec wants it RUNNING or PAUSED (round 6b: a node
        cannot bring back an instance the control plane stopped, after a reboot or a stop). `resumes` (a
        paused guest let run again): `instance-not-running` unless the spec wants it RUNNING (a node
        cannot run a guest the control plane paused). `unpaused` (with `starts`: a start or restore not
        asked `--paused`): `instance-not-running` unless the spec wants it RUNNING (round 7: else a node
        destroys a guest the control plane paused and starts it again running, past the resume rule).
        `runtime` (the op's runtime, `libvirt-kvm` or `cloud-hypervisor`): `spec-mismatch` unless the spec
        runs the instance under it (round 7: else the node ran it under the other runtime too, a second
        guest of one instance, with the same tap names)."""
        checked = self.check_spec(op, intent, now)
        if not checked.roots:
            return None, checked.next_state
        decoded = checked.decoded
        assert decoded is not None  # verified against the roots
        section = decoded.full.instances if decoded.full is not None else None
        if section is None and decoded.patch is not None:
            section = decoded.patch.instances
        named = [i for i in (section.instances if section is not None else []) if i.id == instance_id]
        if len(named) != 1 or int(named[0].desired_state) == 4:
            raise Refused(
                "not-in-spec",
                f"{op}: {instance_id}: the signed spec (generation {decoded.generation}) does not name it "
                "as an instance to run",
            )
        desired = int(named[0].desired_state)
        if runtime is not None and named[0].runtime != runtime:
            raise Refused(
                "spec-mismatch",
                f"{op}: {instance_id}: the signed spec (generation {decoded.generation}) runs it under "
                f"{named[0].runtime[:40]!r}, not {runtime}",
            )
        if starts and desired not in RUNS:
            raise Refused(
                "instance-stopped",
                f"{op}: {instance_id}: the signed spec (generation {decoded.generation}) wants it "
                f"{DESIRED_NAMES.get(desired, str(desired))}: root starts only an instance it wants RUNNING "
                "or PAUSED",
            )
        if starts and unpaused and desired != RUNNING:
            raise Refused(
                "instance-not-running",
                f"{op}: {instance_id}: paused: the signed spec (generation {decoded.generation}) wants it "
                f"{DESIRED_NAMES.get(desired, str(desired))}: root starts it only paused",
            )
        if resumes and desired != RUNNING:
            raise Refused(
                "instance-not-running",
                f"{op}: {instance_id}: the signed spec (generation {decoded.generation}) wants it "
                f"{DESIRED_NAMES.get(desired, str(desired))}: root resumes only an instance it wants RUNNING",
            )
        return named[0], checked.next_state

    # --- a signed spec, whatever the op -------------------------------------------------------------

    def check_spec(
        self, op: str, intent: Any | None, now: dt.datetime | None = None, *, decode_unverified: bool = False
    ) -> SpecCheck:
        """The common signed-spec rules (chain, signature, strict decoding, node, generation never older)
        for `op`; raises Refused. Without roots (HST-SIGN-33) nothing is verified: `decoded` is the
        strictly decoded, unverified body the node sent (None without one) and `roots` is False. The
        caller checks its own section, then writes `next_state` (when not None) before the effect."""
        now = now or _now()
        presented = None
        chain: tuple[bytes, ...] = ()
        if intent is not None:
            if intent.trust_bundle is not None:
                presented = _b64(intent.trust_bundle, "trust_bundle", op)
            chain = tuple(_b64(c, f"chain[{i}]", op) for i, c in enumerate(intent.chain))
        old = self.load_state(op)
        view = self.trust(op, presented, chain, old)
        if view.roots is None:  # nothing names roots (HST-SIGN-33): nothing is verified
            decoded = None
            if intent is not None and decode_unverified:
                try:
                    body = _b64(intent.body, "body", op)
                    decoded, _unknown = decode_spec_body(body, max_fields=MAX_UNSIGNED_FIELDS)
                except WireError as exc:
                    raise Refused("bad-intent", f"{op}: the spec does not decode: {exc}") from None
            return SpecCheck(decoded, view.state if view.state != old else None, False, view.source)
        if intent is None:
            raise Refused(
                "intent-required",
                f"{op}: a signed spec is required (command-signing roots from {view.source})",
            )
        state = view.state
        body = _b64(intent.body, "body", op)
        signature = _b64(intent.signature, "signature", op)
        digest = hashlib.sha256(body).hexdigest()
        known = next(
            (v for v in state.verified if v.sha256 == digest and v.generation == state.generation), None
        )
        at = dt.datetime.fromtimestamp(known.verified_at_ms / 1000, dt.UTC) if known is not None else now
        try:
            verify_desired_state(body, signature, chain, view.roots, at, self.chains)
        except PkiError as exc:
            raise Refused("bad-intent", f"{op}: the signed spec is refused: {exc}") from None
        try:
            decoded, _unknown = decode_spec_body(body)
        except WireError as exc:
            raise Refused("bad-intent", f"{op}: the signed spec does not decode: {exc}") from None
        if state.node_id and decoded.node_id != state.node_id:
            why = "root's join record" if state.node_source == "record" else "the first signed spec accepted"
            raise Refused(
                "wrong-node",
                f"{op}: the signed spec is for node {decoded.node_id!r}; this helper serves "
                f"{state.node_id!r} ({why})",
            )
        if decoded.generation < state.generation:
            raise Refused(
                "stale-generation",
                f"{op}: the signed spec's generation {decoded.generation} is older than generation "
                f"{state.generation} already accepted",
            )
        if decoded.generation > state.generation:
            verified: tuple[Verified, ...] = (Verified(digest, decoded.generation, _ms(now)),)
        elif known is None:
            verified = (*state.verified, Verified(digest, decoded.generation, _ms(now)))[-MAX_VERIFIED:]
        else:
            verified = state.verified
        node_id, source = state.node_id, state.node_source
        if not node_id:  # no join record: trust on first use (HST-SIGN-23)
            node_id, source = decoded.node_id, "first-signed-spec"
        new = attrs.evolve(
            state,
            generation=max(state.generation, decoded.generation),
            verified=verified,
            node_id=node_id,
            node_source=source,
            signed=True,
        )
        return SpecCheck(decoded, new if new != old else None, True, view.source)

    # --- host.unit ------------------------------------------------------------------------------------

    def check_host_unit(
        self, unit: str, settings: str | None, intent: Any | None, now: dt.datetime | None = None
    ) -> IntentState | None:
        """Raise Refused unless the request is inside the signed-spec rules; the state to write (None:
        nothing to write). `intent` has `body`, `signature`, `chain`, `trust_bundle` (base64 text)."""
        op = "host.unit"
        checked = self.check_spec(op, intent, now)
        if not checked.roots:
            return checked.next_state
        decoded = checked.decoded
        assert decoded is not None
        # A full spec decides the host section (unset: no units, so every unit may be cleaned); a patch
        # speaks for it only when it sets it.
        units: list[Any] | None = None
        if decoded.full is not None:
            units = list(decoded.full.host.units) if decoded.full.host is not None else []
        elif decoded.patch is not None and decoded.patch.host is not None:
            units = list(decoded.patch.host.units)
        if units is None:
            raise Refused(
                "bad-intent", f"{op}: the signed spec (generation {decoded.generation}) sets no host section"
            )
        named = [u.settings for u in units if u.name == unit]
        if settings is not None:
            if named != [settings]:
                what = (
                    "does not name it"
                    if not named
                    else ("names it twice" if len(named) > 1 else "gives other settings")
                )
                raise Refused(
                    "settings-mismatch",
                    f"{op}: {unit}: the signed spec (generation {decoded.generation}) {what}: "
                    "the settings must be exactly the signed ones",
                )
        elif named:
            raise Refused(
                "clean-refused",
                f"{op}: {unit}: the signed spec (generation {decoded.generation}) still names it: "
                "a clean is allowed only for a unit the spec no longer names",
            )
        return checked.next_state

    # --- a signed command (gpu.reset, node.reboot) ---------------------------------------------------

    def check_command(self, op: str, command: Any | None, now: dt.datetime | None = None) -> Any | None:
        """With command-signing roots, the signed Command the node forwards: a `command` signature of a
        worker chained to the roots (DLV-SIG-01), kind `op`, for the node root is bound to (the record's,
        or the first signed spec's), `not_after` still ahead. Returns the decoded CommandBody (None where
        nothing names roots: nothing is checked, HST-SIGN-33); raises Refused. Nothing is written."""
        from bcd_shared.pki import verify_command
        from bcd_shared.wire import CommandBody
        from bcd_shared.wire.strict import decode as strict_decode

        now = now or _now()
        presented = None
        chain: tuple[bytes, ...] = ()
        if command is not None:
            if command.trust_bundle is not None:
                presented = _b64(command.trust_bundle, "command.trust_bundle", op)
            chain = tuple(_b64(c, f"command.chain[{i}]", op) for i, c in enumerate(command.chain))
        view = self.trust(op, presented, chain)
        if view.roots is None:
            return None
        if command is None:
            raise Refused(
                "command-required",
                f"{op}: the signed command is required (command-signing roots from {view.source})",
            )
        body = _b64(command.body, "command.body", op)
        signature = _b64(command.signature, "command.signature", op)
        try:
            verify_command(body, signature, chain, view.roots, now, self.chains)
        except PkiError as exc:
            raise Refused("bad-command", f"{op}: the signed command is refused: {exc}") from None
        try:
            decoded = strict_decode(CommandBody, body)
        except WireError as exc:
            raise Refused("bad-command", f"{op}: the signed command does not decode: {exc}") from None
        if decoded.kind != op:
            raise Refused("command-mismatch", f"{op}: the signed command is a {decoded.kind!r}, not {op!r}")
        node = view.state.node_id
        if not node:
            raise Refused(
                "intent-unverifiable",
                f"{op}: this helper is bound to no node yet (no join record, no signed spec accepted)",
            )
        if decoded.node_id != node or decoded.target_node_id not in ("", node):
            raise Refused(
                "wrong-node",
                f"{op}: the signed command is for node {decoded.target_node_id or decoded.node_id!r}; "
                f"this helper serves {node!r}",
            )
        if decoded.not_after <= _ms(now):
            raise Refused(
                "command-expired",
                f"{op}: the signed command's not_after ({decoded.not_after} ms) has passed (or is absent)",
            )
        return decoded

    # --- daemon.swap ----------------------------------------------------------------------------------

    def release_roots(self, op: str, presented: bytes | None, chain: Sequence[bytes]) -> Roots:
        """The roots a release signature must chain to: the same sources as host.unit's; a release is
        always verified, so no roots at all is a refusal. Nothing is written."""
        view = self.trust(op, presented, chain)
        if view.roots is None:
            raise Refused(
                "intent-unverifiable",
                f"{op}: no command-signing roots (command_root_sha256, root's join record or a trust bundle) "
                "to verify the release against",
            )
        return view.roots
