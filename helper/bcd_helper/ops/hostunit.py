"""host.unit: one config unit re-planned and applied as root from its name and settings alone.

Rules (host-config.md "Under bcd helper"; HST-HLP-03..12, 20..23, 33..36):
- the unit name must match `^[a-z0-9-]{1,64}$`, else `not a config unit name`;
- at most 1024 busy GPUs, each a device id of at most 128 characters;
- `[host] units = false` in root's config refuses every host.unit, applies and cleans alike, with
  `host.unit: this host's configuration is managed outside bcd ([host] units = false in root's
  config.toml)`, writing nothing;
- a helper without host units (bcd_shared.units missing or offering no REGISTRY) answers
  `not configured`; an unknown unit is `not supported`;
- the unit decodes and validates the settings itself (`settings` is the canonical JSON text; None
  cleans a unit that left the spec), with root's `[kubernetes] allowed_clusters`; for `sysctl`, root's
  `[host] sysctl_allow` (when set) refuses every key outside its prefixes;
- for `mig-layout` the helper ignores the node's busy GPUs and uses root's own view
  (bcd_helper.busy, with `passthrough`: a VM's GPU too), its reasons in the unit's retryable issue,
  and holds the `gpus` lock from that read to the unit's end (a VM start, a reset or a hold write never
  passes between); for every other unit the node's list is passed through;
- writes go through the root-only rule (BoundedSystem, and the units' own path guard), programs
  are bounded to 20 minutes each, the operation to 30 minutes; k8s-join reads the token the node
  staged with file kind `k8s-token`;
- signed intent (host-config.md "Signed specs"; bcd_helper.intent): after the argument rules and
  `[host] units`, the request's `intent` is checked against the command-signing roots of root's pins,
  root's join record or a trust bundle the node presents; the next intent state is written to
  helper-intent.json only once the unit and its settings also passed, before the unit is applied
  (a refused request writes nothing).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from attrs import frozen

from bcd_helper.busy import ALL, BusyUnknown, busy_gpus, known_gpus
from bcd_helper.ops.base import Call, Failed, Refused

UNIT_NAME_RE = re.compile(r"^[a-z0-9-]{1,64}$")
MAX_BUSY = 1024
MAX_SETTINGS = 256 * 1024
EXTERNAL_MESSAGE = (
    "host.unit: this host's configuration is managed outside bcd ([host] units = false in root's config.toml)"
)


@frozen
class SignedIntent:
    """The signed DesiredState body that last set the host section, as the node keeps it (base64)."""

    body: str
    signature: str
    chain: tuple[str, ...] = ()
    trust_bundle: str | None = None


@frozen
class HostUnit:
    unit: str
    settings: str | None = None
    busy_gpus: tuple[str, ...] = ()
    intent: SignedIntent | None = None


def check_request(call: Call, req: HostUnit) -> None:
    """The argument rules, in order; raises Refused."""
    if not UNIT_NAME_RE.fullmatch(req.unit):
        raise Refused("bad-unit-name", f"host.unit: {req.unit!r} is not a config unit name")
    if len(req.busy_gpus) > MAX_BUSY:
        raise Refused("too-many-busy-gpus", f"host.unit: {len(req.busy_gpus)} busy GPUs, at most {MAX_BUSY}")
    for i, dev in enumerate(req.busy_gpus):
        if not dev or len(dev) > 128 or any(c.isspace() or ord(c) < 0x20 for c in dev):
            raise Refused("bad-busy-gpu", f"host.unit: busy_gpus[{i}] is not a device id")
    if req.settings is not None and len(req.settings.encode()) > MAX_SETTINGS:
        raise Refused("too-large", f"host.unit: settings larger than {MAX_SETTINGS} bytes")
    if not call.ctx.config.host_units:
        raise Refused("host-managed-externally", EXTERNAL_MESSAGE)


def unit_registry() -> Mapping[str, Any] | None:
    """The host units bcd_shared provides (name -> unit), or None for a helper built without them."""
    try:
        module = importlib.import_module("bcd_shared.units")
    except ImportError:
        return None
    registry = getattr(module, "REGISTRY", None)
    return registry if isinstance(registry, Mapping) else None


@contextlib.contextmanager
def _holding_gpus(call: Call) -> Iterator[None]:
    """The helper's `gpus` lock (after the op's `units`, as LOCK_ORDER takes them): `mig-layout` changes
    what the GPUs are, so its busy read and its changes never pass beside a VM start, a reset or a hold
    write, which take `gpus` too (round 8). Not had before the call's deadline: `busy`."""
    lock = call.ctx.locks.get("gpus")
    if lock is None:  # a context without the op locks (in process)
        yield
        return
    if not lock.acquire(timeout=max(call.deadline.remaining(), 0.001)):
        raise Refused("busy", "host.unit: mig-layout: another operation holds the helper's gpus lock")
    try:
        yield
    finally:
        lock.release()


def host_unit(call: Call, req: HostUnit) -> dict[str, Any]:
    check_request(call, req)
    verifier = call.ctx.intent_verifier()
    next_state = verifier.check_host_unit(req.unit, req.settings, req.intent)
    registry = unit_registry()
    if registry is None:
        raise Refused("not-configured", "host.unit: not configured (this helper has no host units)")
    unit = registry.get(req.unit)
    if unit is None:
        raise Refused("not-supported", f"host.unit: {req.unit}: not supported")
    with _holding_gpus(call) if req.unit == "mig-layout" else contextlib.nullcontext():
        return _converge(call, req, unit, verifier, next_state)


def _converge(call: Call, req: HostUnit, unit: Any, verifier: Any, next_state: Any) -> dict[str, Any]:
    """Root's busy GPUs (mig-layout), the settings' own rules, root's intent state, then the unit."""
    units = importlib.import_module("bcd_shared.units")
    from bcd_shared.errors import StepError

    reasons: tuple[tuple[str, str], ...] = ()
    if req.unit == "mig-layout":
        try:
            view = busy_gpus(call.system, passthrough=True)
            busy = view.gpus()
            if ALL in busy:  # a MIG process or an unreadable hold: every GPU is busy
                busy = (busy - {ALL}) | frozenset(known_gpus(call.system) or ())
                every = next(why for g, why in view.by_gpu if g == ALL)
                reasons = tuple((g, every) for g in sorted(busy))
            reasons = view.by_gpu + reasons
        except BusyUnknown as exc:
            raise Failed("busy-unknown", f"host.unit: {exc}") from None
    else:
        busy = frozenset(req.busy_gpus)
    pins = tuple(units.ClusterPin(c.server, c.ca_sha256) for c in call.ctx.config.allowed_clusters)
    uctx = units.UnitContext(busy_gpus=busy, allowed_clusters=pins, busy_reasons=reasons)
    try:
        settings = None if req.settings is None else unit.decode_settings(req.settings)
    except StepError as exc:
        raise Refused("invalid-settings", f"host.unit: {req.unit}: {exc.message}") from None
    except RecursionError:  # nested past the decoder's recursion: not settings any unit takes
        raise Refused("invalid-settings", f"host.unit: {req.unit}: settings nested too deeply") from None
    allow = call.ctx.config.sysctl_allow
    if req.unit == "sysctl" and allow and settings is not None:
        from bcd_shared.units.sysctl import outside_allowlist

        for key, _value in settings.values:
            if outside_allowlist(key, allow):
                raise Refused(
                    "invalid-settings",
                    f"host.unit: sysctl: {key} is refused: not under root's [host] sysctl_allow",
                )
    if next_state is not None:  # durable before effect: root's intent state, then the unit
        verifier.save_state(next_state)
    actx = units.ApplyContext(guard=call.system.guard, tokens=units.StagedTokenSource(call.system))
    result = units.converge_unit(unit, settings, call.system, uctx, actx)
    return {
        "unit": req.unit,
        "changed": result.changed,
        "steps": list(result.steps_done),
        "issues": [{"kind": i.kind, "message": i.message} for i in result.issues],
        "conditions": [{"type": c.type, "reason": c.reason, "message": c.message} for c in result.conditions],
    }
