"""`bcd plan --spec FILE [--root DIR]`: the operator's dry run, and the spec-file reader.

A dry run reads the live (or, with `--root`, the simulated) host once and runs every section's pure
planner against it, printing the steps each section would take. Nothing is applied: the planners
are pure (desired + observed -> steps) and this module never calls an applier, an executor or the
helper.

Spec files are NodeSpecs in protobuf's JSON mapping (the form the control plane stores in
`nodes.spec`, and the examples/ use). `load_spec_file` reads one strictly (house rule 4): an unknown
key, a key given twice (also as its proto name and its JSON name), a value of the wrong JSON type,
an integer out of its field's range, an enum name that does not exist or trailing data all refuse
the file with a `SpecFileError` naming the field path (`devices.assignments[0].limits.cpuMillis`)
and the rule. The result is a `wire.NodeSpec`; `desired_from_nodespec` turns it into the runner's
DesiredSpec (each section's payload is its wire message; the sections convert them once).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import enum
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import betterproto2
from attrs import frozen
from bcd_shared import wire
from bcd_shared.errors import StepError
from bcd_shared.pki import Purpose
from bcd_shared.shown import shown
from bcd_shared.strictjson import unique_keys
from bcd_shared.system import LocalSystem, System

from bcd_agent.converge.types import SECTION_ORDER, DesiredSpec
from bcd_agent.sections.devices.slices import HUGETLB_FILES, SliceSpec

M = TypeVar("M", bound=betterproto2.Message)

# --- spec files ---------------------------------------------------------------------------------------


class SpecFileError(ValueError):
    """A spec file refused: `path` names the field (empty for the document), `rule` what was broken."""

    def __init__(self, source: str, path: str, rule: str) -> None:
        self.source = source
        self.path = path
        self.rule = rule
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {rule}")


_INT_RANGES: dict[str, tuple[int, int]] = {
    betterproto2.TYPE_INT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SINT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_UINT32: (0, 2**32 - 1),
    betterproto2.TYPE_FIXED32: (0, 2**32 - 1),
    betterproto2.TYPE_INT64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_SINT64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_UINT64: (0, 2**64 - 1),
    betterproto2.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOATS = frozenset({betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE})


def json_name(field_name: str) -> str:
    """proto3's JSON name of a field: lowerCamelCase of the snake_case name."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _meta(cls: Any) -> Any:
    # betterproto2 types this class property for concrete message classes only.
    return cls._betterproto


def _sub(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


class _Decoder:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, path: str, rule: str) -> SpecFileError:
        return SpecFileError(self.source, path, rule)

    def message(self, cls: type[M], value: object, path: str) -> M:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a JSON object ({cls.__name__}), got {_kind(value)}")
        meta = _meta(cls)
        fields: Mapping[str, Any] = meta.meta_by_field_name
        by_key: dict[str, str] = {}
        for name in fields:
            by_key[name] = name
            by_key[json_name(name)] = name
        kwargs: dict[str, Any] = {}
        given_as: dict[str, str] = {}
        groups: dict[str, str] = {}
        for key, item in value.items():
            where = _sub(path, key)
            found = by_key.get(key)
            if found is None:
                known = ", ".join(json_name(n) for n in fields)
                raise self.fail(where, f"unknown field of {cls.__name__} (known: {known})")
            name = found
            if name in given_as:
                raise self.fail(where, f"given twice (also as {given_as[name]!r})")
            given_as[name] = key
            fm = fields[name]
            if fm.group:
                other = groups.get(fm.group)
                if other is not None:
                    raise self.fail(where, f"oneof {fm.group} is already set by {other!r}")
                groups[fm.group] = key
            if item is None:
                continue  # JSON null: the field's default (proto3 JSON mapping)
            kwargs[name] = self.field(cls, name, fm, item, where)
        return cls(**kwargs)

    def field(self, cls: type[betterproto2.Message], name: str, fm: Any, value: object, path: str) -> Any:
        field_cls = _meta(cls).cls_by_field.get(name)
        if fm.proto_type == betterproto2.TYPE_MAP:
            if not isinstance(value, dict):
                raise self.fail(path, f"must be a JSON object (a map), got {_kind(value)}")
            key_meta, value_meta = fm.map_meta
            out: dict[Any, Any] = {}
            for k, v in value.items():
                if key_meta.proto_type != betterproto2.TYPE_STRING:
                    raise self.fail(_sub(path, k), "maps with non-string keys are not used in NodeSpec")
                value_cls = _meta(field_cls).cls_by_field.get("value") if field_cls else None
                out[k] = self.scalar(value_meta.proto_type, value_cls, v, _sub(path, k))
            return out
        if fm.repeated:
            if not isinstance(value, list):
                raise self.fail(path, f"must be a JSON array, got {_kind(value)}")
            return [self.single(fm.proto_type, field_cls, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return self.single(fm.proto_type, field_cls, value, path)

    def single(self, proto_type: str, field_cls: Any, value: object, path: str) -> Any:
        if value is None:
            raise self.fail(path, "null is not a value here")
        if proto_type == betterproto2.TYPE_MESSAGE:
            return self.message(field_cls, value, path)
        return self.scalar(proto_type, field_cls, value, path)

    def scalar(self, proto_type: str, field_cls: Any, value: object, path: str) -> Any:
        if proto_type == betterproto2.TYPE_MESSAGE:
            return self.message(field_cls, value, path)
        if proto_type == betterproto2.TYPE_STRING:
            if not isinstance(value, str):
                raise self.fail(path, f"must be a JSON string, got {_kind(value)}")
            return value
        if proto_type == betterproto2.TYPE_BOOL:
            if not isinstance(value, bool):
                raise self.fail(path, f"must be true or false, got {_kind(value)}")
            return value
        if proto_type in _INT_RANGES:
            return self.integer(proto_type, value, path)
        if proto_type in _FLOATS:
            if isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity"):
                return float(value.replace("Infinity", "inf"))
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.fail(path, f"must be a JSON number, got {_kind(value)}")
            return float(value)
        if proto_type == betterproto2.TYPE_BYTES:
            if not isinstance(value, str):
                raise self.fail(path, f"must be a base64 JSON string, got {_kind(value)}")
            try:
                padded = value + "=" * (-len(value) % 4)
                if "-" in value or "_" in value:
                    return base64.urlsafe_b64decode(padded)
                return base64.b64decode(padded, validate=True)
            except (binascii.Error, ValueError):
                raise self.fail(path, "is not base64") from None
        if proto_type == betterproto2.TYPE_ENUM:
            return self.enum_value(field_cls, value, path)
        raise self.fail(path, f"protobuf type {proto_type} is not supported in spec files")

    def integer(self, proto_type: str, value: object, path: str) -> int:
        low, high = _INT_RANGES[proto_type]
        number: int
        if isinstance(value, bool):
            raise self.fail(path, f"must be an integer ({proto_type}), got a boolean")
        whole_float = isinstance(value, float) and math.isfinite(value) and value.is_integer()
        decimal = isinstance(value, str) and value.lstrip("-").isdigit() and value.isascii()
        if isinstance(value, int | float | str) and (isinstance(value, int) or whole_float or decimal):
            number = int(value)
        else:
            raise self.fail(path, f"must be an integer ({proto_type}) as a JSON number or decimal string")
        if not low <= number <= high:
            raise self.fail(path, f"{number} is out of range for {proto_type} ({low}..{high})")
        return number

    def enum_value(self, enum_cls: type[enum.IntEnum], value: object, path: str) -> Any:
        names = {self.proto_name(enum_cls, m): m for m in enum_cls}
        if isinstance(value, str):
            member = names.get(value)
            if member is None:
                raise self.fail(path, f"{value!r} is not a {enum_cls.__name__} (one of {', '.join(names)})")
            return member
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**31) <= value < 2**31:
                raise self.fail(path, f"{value} is out of range for an enum")
            return enum_cls(value)  # proto3 enums are open: an unknown number is kept
        raise self.fail(path, f"must be an enum name or number, got {_kind(value)}")

    @staticmethod
    def proto_name(enum_cls: type[enum.IntEnum], member: enum.IntEnum) -> str:
        proto_names = getattr(enum_cls, "betterproto_value_to_renamed_proto_names", None)
        if callable(proto_names):
            mapping = proto_names()
            if isinstance(mapping, dict) and int(member) in mapping:
                return str(mapping[int(member)])
        return _enum_prefix(enum_cls) + str(member.name)


def _enum_prefix(enum_cls: type[enum.IntEnum]) -> str:
    # betterproto2 strips the enum's SCREAMING_CASE prefix (Binding.HOLD for BINDING_HOLD).
    out = []
    for i, ch in enumerate(enum_cls.__name__):
        if ch.isupper() and i:
            out.append("_")
        out.append(ch.upper())
    return "".join(out) + "_"


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _pairs(source: str) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    return unique_keys(lambda k: SpecFileError(source, k, "key appears twice in one JSON object"))


def _constant(source: str) -> Callable[[str], Any]:
    def refuse(name: str) -> Any:
        raise SpecFileError(source, "", f"{name} is not JSON")

    return refuse


def parse_message_json(cls: type[M], text: str | bytes, source: str = "<spec>") -> M:
    """Strictly decode `text` (protobuf's JSON mapping) into a `cls` message."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise SpecFileError(source, "", "is not UTF-8") from None
    try:
        doc = json.loads(text, object_pairs_hook=_pairs(source), parse_constant=_constant(source))
    except json.JSONDecodeError as e:
        raise SpecFileError(source, "", f"is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    return _Decoder(source).message(cls, doc, "")


def parse_spec_json(text: str | bytes, source: str = "<spec>") -> wire.NodeSpec:
    """A NodeSpec from protobuf JSON; every section's settings are still the sections' to check."""
    return parse_message_json(wire.NodeSpec, text, source)


def load_spec_file(path: str | Path) -> wire.NodeSpec:
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SpecFileError(str(p), "", f"cannot be read: {e.strerror}") from None
    return parse_spec_json(data, str(p))


def spec_hash(spec: wire.NodeSpec) -> str:
    """A local stand-in for the control plane's spec_hash (the dry run has no server's hash to echo)."""
    return "sha256:" + hashlib.sha256(bytes(spec)).hexdigest()


def desired_from_nodespec(spec: wire.NodeSpec, generation: int, hash_: str = "") -> DesiredSpec:
    """The runner's DesiredSpec: each section's wire message (None when unset)."""
    sections: dict[str, object | None] = {name: getattr(spec, name, None) for name in SECTION_ORDER}
    return DesiredSpec(generation=generation, spec_hash=hash_ or spec_hash(spec), sections=sections)


# --- the dry run --------------------------------------------------------------------------------------


@frozen
class SectionPlan:
    """What one section would do: its steps (described), and why it would stop, if it would."""

    section: str
    planner: str  # "host units", "devices", "instances", "access", "telemetry", or "none" (no converger)
    steps: tuple[str, ...] = ()
    failures: tuple[str, ...] = ()
    conditions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # devices: the holds this plan would bind and release, `<allocation>: <atom>, ...`.
    binds: tuple[str, ...] = ()
    releases: tuple[str, ...] = ()

    @property
    def converged(self) -> bool:
        return not self.steps and not self.failures


class _NoEffects:
    """The executor a dry run hands the devices section: planning never reaches it; applying would fail."""

    def _refuse(self) -> None:
        raise RuntimeError("bcd plan applies nothing")

    def write_cdi(self, allocation_id: str, data: bytes) -> None:
        self._refuse()

    def remove_cdi(self, allocation_id: str) -> None:
        self._refuse()

    def write_env(self, allocation_id: str, data: bytes) -> None:
        self._refuse()

    def remove_env(self, allocation_id: str) -> None:
        self._refuse()

    def apply_slice(self, spec: SliceSpec, reset: tuple[str, ...] = ()) -> None:
        self._refuse()

    def stop_slice(self, name: str) -> None:
        self._refuse()


class _NoSigner:
    """The dry run signs nothing (the planner never signs; the applier would)."""

    node_id = ""
    boot_id = ""

    def sign(self, purpose: Purpose, data: bytes) -> bytes:
        raise RuntimeError("bcd plan signs nothing")


# Units whose action takes several observe-plan-apply rounds (MIG mode before instances; a package
# install before the join): a dry run shows their first round only.
MULTI_ROUND_UNITS = frozenset({"mig-layout", "k8s-join", "nvidia-driver", "container-toolkit"})


def plan_host(payload: object | None, system: System) -> SectionPlan:
    from bcd_shared import units

    if not isinstance(payload, wire.HostSection) or not payload.units:
        return SectionPlan("host", "host units", notes=("no units in the spec",))
    steps: list[str] = []
    failures: list[str] = []
    conditions: list[str] = []
    notes: list[str] = []
    ctx = units.UnitContext()
    wanted = {u.name: u for u in payload.units}
    for name in sorted(wanted, key=lambda n: units.ORDER.index(n) if n in units.ORDER else len(units.ORDER)):
        unit = units.REGISTRY.get(name)
        if unit is None:
            failures.append(f"{name}: not a config unit this bcd knows")
            continue
        try:
            settings = unit.decode_settings(wanted[name].settings)
            unit.validate(settings, ctx)
            planned = unit.plan(settings, unit.observe(system, settings, ctx))
        except StepError as e:
            (failures if e.terminal else notes).append(f"{name}: {e.reason}: {e.message}")
            continue
        steps.extend(f"{name}: {s.describe()}" for s in planned.steps)
        for issue in planned.issues:
            (failures if issue.kind == "terminal" else notes).append(f"{name}: {issue.message}")
        conditions.extend(f"{name}: {c.type}" for c in planned.conditions)
        if name in MULTI_ROUND_UNITS and planned.steps:
            notes.append(f"{name}: shows the first round; later rounds are planned after these steps apply")
    return SectionPlan("host", "host units", tuple(steps), tuple(failures), tuple(conditions), tuple(notes))


def plan_devices(payload: object | None, generation: int, system: System, data_dir: str) -> SectionPlan:
    from bcd_agent.sections.devices.events import MemorySink
    from bcd_agent.sections.devices.section import DevicesSection

    section = DevicesSection(system, _NoEffects(), MemorySink(), _NoSigner(), data_dir)
    try:
        the_plan = section.plan(payload, generation)
    except StepError as e:
        return SectionPlan("devices", "devices", notes=(f"cannot observe the host: {e.reason}: {e.message}",))
    steps = tuple(f"{a.kind} {a.key}: {describe_device_step(s)}" for a in the_plan.actions for s in a.steps)
    failures = tuple(f"{f.allocation_id}: {f.reason}: {f.message}" for f in the_plan.failures)
    conditions = tuple(f"{c.type}: {c.reason}: {c.message}" for c in the_plan.conditions)
    holders = tuple(f"{alloc} holds {', '.join(atoms)}" for alloc, atoms in sorted(the_plan.holders.items()))
    binds, releases = device_changes(the_plan)
    return SectionPlan(
        "devices", "devices", steps, failures, conditions, tuple(the_plan.warnings) + holders, binds, releases
    )


def plan_instances(payload: object | None, generation: int, system: System, data_dir: str) -> SectionPlan:
    """The instances section's dry run: its runtimes list (read-only), then the pure planner. User data
    is never fetched in a dry run: instances that need it show as waiting for it."""
    from bcd_agent.sections.instances import plan as ip
    from bcd_agent.sections.instances.runtimes.libvirt import DirectVirsh, LibvirtRuntime
    from bcd_agent.sections.instances.section import InstancesSection, runtimes_on_path

    simulated = system.root != Path("/")
    runtimes = (
        [LibvirtRuntime(system, DirectVirsh(system), data_dir)] if simulated or runtimes_on_path() else []
    )
    section = InstancesSection(system, runtimes, data_dir)
    try:
        the_plan = section.plan(payload, generation)
    except StepError as e:
        return SectionPlan(
            "instances", "instances", notes=(f"cannot observe the host: {e.reason}: {e.message}",)
        )
    if the_plan.section_error is not None:
        return SectionPlan("instances", "instances", failures=(the_plan.section_error,))

    def describe(step: object) -> str:
        if isinstance(step, ip.Create):
            i = step.instance
            what = f"{i.vcpus} vCPUs, {i.memory_bytes >> 20} MiB"
            if i.image is not None:
                what += f", image {i.image.sha256[:12]} ({i.image.format})"
            if step.gpu_addresses:
                what += f", GPUs {', '.join(step.gpu_addresses)}"
            return f"define {i.id} ({what})"
        if isinstance(step, ip.Grow):
            return f"grow {step.instance.id}'s disk to {step.instance.disk_bytes} bytes"
        if isinstance(step, ip.Start):
            return f"start {step.name}{' paused' if step.paused else ''}"
        return f"{type(step).__name__.lower()} {getattr(step, 'name', '')}"

    steps = tuple(describe(s) for s in the_plan.steps)
    failures = tuple(f"{i}: {m}" for i, m in the_plan.errors.items())
    notes = tuple(f"{i}: {m}" for i, m in {**the_plan.waiting, **the_plan.notes}.items()) + tuple(
        the_plan.warnings
    )
    return SectionPlan("instances", "instances", steps, failures, (), notes)


def device_changes(the_plan: object) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The binds and releases a devices plan would make, in plan order (`<allocation>: <atoms>`)."""
    from bcd_agent.sections.devices import plan as dp
    from bcd_agent.sections.devices.events import ReleasedEvent

    assert isinstance(the_plan, dp.Plan)
    binds: list[str] = []
    releases: list[str] = []
    for action in the_plan.actions:
        events = [s.event for s in action.steps if isinstance(s, dp.Emit)]
        if action.kind in ("bind", "rebind"):  # a rebind: written over in place (Q-DEV-PASS-01)
            alloc = action.key.split(":", 1)[1]
            slices = [s.slice.name for s in action.steps if isinstance(s, dp.ApplySlice)]
            where = f" in {slices[0]}" if slices else ""
            binds.append(f"{alloc}: {', '.join(the_plan.holders.get(alloc, ()))}{where}")
        for ev in events:
            if isinstance(ev, ReleasedEvent):
                kind = " (Kubernetes)" if ev.kubernetes else ""
                releases.append(f"{ev.allocation_id}: {', '.join(ev.device_ids)}{kind}")
        if action.kind == "kube-release" and not any(isinstance(e, ReleasedEvent) for e in events):
            alloc = action.key.split(":", 1)[1]
            pending = [
                r
                for s in action.steps
                if isinstance(s, dp.WriteReleases)
                for r in s.releases
                if r.allocation_id == alloc
            ]
            ids = ", ".join(pending[0].device_ids) if pending else ""
            releases.append(f"{alloc}: {ids} (Kubernetes: reported once no pod holds them)")
    return tuple(binds), tuple(releases)


def describe_device_step(step: object) -> str:
    """One devices step in words (the steps are frozen values of sections/devices/plan.py)."""
    from bcd_agent.sections.devices import plan as dp

    if isinstance(step, dp.WriteSpec):
        return f"write /etc/cdi/bcd-{step.allocation_id}.json"
    if isinstance(step, dp.RemoveSpec):
        return f"remove /etc/cdi/bcd-{step.allocation_id}.json"
    if isinstance(step, dp.WriteEnv):
        return f"write /run/bcd/allocations/{step.allocation_id}.env ({len(step.lines)} lines)"
    if isinstance(step, dp.RemoveEnv):
        return f"remove /run/bcd/allocations/{step.allocation_id}.env"
    if isinstance(step, dp.ApplySlice):
        limits = ", ".join(f"{k}={v}" for k, v in step.slice.properties)
        huge = ", ".join(f"{HUGETLB_FILES[s]}.max={b}" for s, b in step.slice.hugetlb_max)
        what = "; ".join(x for x in (limits, huge) if x)
        reset = f"; reset {', '.join(step.reset)}" if step.reset else ""
        return f"create or update slice {step.slice.name}" + (f" ({what}{reset})" if what or reset else "")
    if isinstance(step, dp.StopSlice):
        return f"stop slice {step.name} once empty"
    if isinstance(step, dp.WriteReleases):
        return f"record {len(step.releases)} pending Kubernetes release(s)"
    if isinstance(step, dp.SetAsideReleases):
        return "set the unreadable releases file aside and write the marker"
    if isinstance(step, dp.RemoveMarker):
        return "remove the releases marker"
    if isinstance(step, dp.Emit):
        ev = step.event
        return f"send {type(ev).__name__.removesuffix('Event')} for {ev.allocation_id}"
    if isinstance(step, dp.WriteLedger):
        return "update the event ledger"
    if isinstance(step, dp.ForgetEventKeys):
        return f"forget {len(step.keys)} journal event key(s)"
    return type(step).__name__


def plan_telemetry(payload: object | None) -> SectionPlan:
    """The telemetry section's plan against an exporter that runs nothing yet (a dry run fetches no
    secret): the headers fetch, then the export it would configure (docs/telemetry.md)."""
    from bcd_shared.errors import TerminalError

    from bcd_agent.sections.telemetry.model import from_wire
    from bcd_agent.sections.telemetry.plan import HeadersLoaded, Observed
    from bcd_agent.sections.telemetry.plan import plan as telemetry_plan

    try:
        spec = from_wire(payload)
    except TerminalError as exc:
        return SectionPlan("telemetry", "telemetry", failures=(f"{exc.reason}: {exc.message}",))
    steps: list[str] = []
    if spec is not None and spec.exports and spec.headers_secret_ref:
        steps.append(f"fetch the export headers {spec.headers_secret_ref} (SecretRequest)")
    configured = telemetry_plan(spec, Observed(None, HeadersLoaded(())))
    for step in configured.steps:
        config = getattr(step, "config", None)
        if config is not None:
            keys = ", ".join(k for k, _ in config.resource) or "none"
            steps.append(
                f"export bcd's metrics to {config.url} every {config.interval_s:g} s"
                f" (resource attributes beside bcd's service.*: {keys})"
            )
    return SectionPlan("telemetry", "telemetry", steps=tuple(steps))


def plan_access(payload: object | None, system: System, node_id: str) -> SectionPlan:
    """The access section's steps (bcd_shared.access.plan) against the files on the host."""
    from bcd_shared import access as acc

    from bcd_agent.sections import access as ax

    spec = ax.AccessSpec.of(payload)
    try:
        desired = acc.render(spec.ca_keys, spec.principals, spec.serials, node_id)
    except acc.AccessInvalid as e:
        return SectionPlan("access", "access", failures=(f"InvalidAccess: {e}",))
    steps = acc.plan(desired, ax.observe(system))
    described = tuple(
        f"write {s.path}"
        if isinstance(s, acc.Write)
        else (f"remove {s.path}" if isinstance(s, acc.Remove) else "reload sshd")
        for s in steps
    )
    notes = (f"{len(desired.skipped)} principal(s) not of this node skipped",) if desired.skipped else ()
    return SectionPlan("access", "access", described, notes=notes)


def plan_all(
    desired: DesiredSpec, system: System, data_dir: str, *, host_units: bool = True, node_id: str = ""
) -> list[SectionPlan]:
    """Every section's dry-run plan, in the seeds' order."""
    from bcd_agent.converge.runner import payload_is_empty

    out: list[SectionPlan] = []
    for name in SECTION_ORDER:
        payload = desired.payload(name)
        if name == "host" and host_units:
            out.append(plan_host(payload, system))
        elif name == "host":
            note = "[host] units = false: the host section is UNSUPPORTED (HostManagedExternally)"
            out.append(SectionPlan("host", "none", notes=() if payload_is_empty(payload) else (note,)))
        elif name == "devices":
            out.append(plan_devices(payload, desired.generation, system, data_dir))
        elif name == "instances":
            out.append(plan_instances(payload, desired.generation, system, data_dir))
        elif name == "telemetry":
            out.append(plan_telemetry(payload))
        elif name == "access":
            out.append(plan_access(payload, system, node_id))
        elif _empty_message(payload):
            out.append(SectionPlan(name, "none"))
        else:
            out.append(
                SectionPlan(
                    name, "none", notes=(f"no converger in this build: would be UNSUPPORTED ({name})",)
                )
            )
    return out


def _empty_message(payload: object | None) -> bool:
    if payload is None:
        return True
    if isinstance(payload, betterproto2.Message):
        return bytes(payload) == b""
    return False


def render(plans: Sequence[SectionPlan]) -> str:
    lines: list[str] = []
    for p in plans:
        state = "nothing to do" if p.converged else f"{len(p.steps)} step(s)"
        if p.failures:
            state += f", {len(p.failures)} failure(s)"
        lines.append(f"{p.section:<10} {state}")
        lines.extend(f"  bind {b}" for b in p.binds)
        lines.extend(f"  release {r}" for r in p.releases)
        lines.extend(f"  - {s}" for s in p.steps)
        lines.extend(f"  ! {f}" for f in p.failures)
        lines.extend(f"  condition {c}" for c in p.conditions)
        lines.extend(f"  note: {n}" for n in p.notes)
    # Steps quote the spec and the host's files: escaped, never raw.
    return "\n".join(shown(line) for line in lines) + "\n"


def to_json(plans: Sequence[SectionPlan]) -> list[dict[str, object]]:
    return [
        {
            "section": p.section,
            "planner": p.planner,
            "converged": p.converged,
            "steps": list(p.steps),
            "failures": list(p.failures),
            "conditions": list(p.conditions),
            "notes": list(p.notes),
            "binds": list(p.binds),
            "releases": list(p.releases),
        }
        for p in plans
    ]


def host_system(root: str) -> System:
    """The host a command reads: `/` itself, or a simulated host directory with its fake tools."""
    if Path(root).resolve() == Path("/"):
        return LocalSystem(Path("/"))
    from bcd_shared.simroot import sim_system

    return sim_system(Path(root).resolve())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bcd_shared.subcommands import positive_int, root_dir

    from bcd_agent.config import add_config_argument

    parser.add_argument("--spec", required=True, help="a NodeSpec in protobuf's JSON mapping")
    parser.add_argument(
        "--root", default="/", type=root_dir, help="the directory standing for / (a simulated host)"
    )
    parser.add_argument("--data-dir", default=None, help="the node's data_dir (default: config's)")
    parser.add_argument(
        "--generation", type=positive_int, default=1, help="the generation to plan at (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--node-id", default="", help="this node's id: the access section's own principals (<account>@<id>)"
    )
    add_config_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every section is converged (nothing to do), 2 when it plans steps or failures
    (terraform plan -detailed-exitcode), 65 for a spec file it refuses, 78 for a refused config."""
    from bcd_shared.simroot import SimHostMissing
    from bcd_shared.subcommands import EX_CHANGES, EX_DATAERR, EX_USAGE, CliError

    from bcd_agent.config import config_of

    try:
        spec = load_spec_file(args.spec)
    except SpecFileError as e:
        raise CliError(str(e), EX_DATAERR) from None
    config = config_of(args)
    data_dir = args.data_dir or config.data_dir
    desired = desired_from_nodespec(spec, max(1, args.generation))
    try:
        system = host_system(args.root)
    except SimHostMissing as e:
        raise CliError(str(e), EX_USAGE) from None
    # --data-dir as `bcd status --data-dir` takes it: a real path. One inside --root names the host's path
    # under it (every section reads data_dir through the simulated host).
    root = system.root.resolve()
    if root != Path("/") and Path(data_dir).resolve().is_relative_to(root):
        data_dir = "/" + str(Path(data_dir).resolve().relative_to(root))
    plans = plan_all(desired, system, data_dir, host_units=config.host.units, node_id=args.node_id)
    if args.json:
        doc = {"generation": desired.generation, "sections": to_json(plans)}
        json.dump(doc, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(plans))
    return 0 if all(p.converged for p in plans) else EX_CHANGES
