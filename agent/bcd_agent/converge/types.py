"""What a section reports after a pass: the contract between sections and the converge runner.

Sections are converged in the seeds' order (host, devices, instances, access, telemetry, daemon,
site). Each section's converger is a pure `plan(desired, observed) -> steps` plus an applier that
runs the steps through an executor (directly as root, or through the helper). A pass ends with one
`SectionOutcome` per section; the runner turns those into SectionStatus and conditions, and
advances observed_generation only when every section is CONVERGED, FAILED or UNSUPPORTED.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from types import MappingProxyType

from attrs import field, frozen

# The seeds' order (delivery.md, "NodeSpec and its sections"), with the protobuf field numbers of
# NodeSpec that SectionUnsupported's reason names.
SECTION_ORDER: tuple[str, ...] = ("host", "devices", "instances", "access", "telemetry", "daemon", "site")


class SectionState(enum.Enum):
    CONVERGED = "CONVERGED"
    PROGRESSING = "PROGRESSING"  # a retryable failure, or work still under way
    FAILED = "FAILED"  # terminal: only a new spec helps
    UNSUPPORTED = "UNSUPPORTED"  # terminal: no converger for a non-empty section

    @property
    def settled(self) -> bool:
        """Counts toward observed_generation (converged or terminal)."""
        return self is not SectionState.PROGRESSING


@frozen
class Condition:
    """A node condition (RebootRequired, FabricManagerDown, SectionUnsupported, ...).

    `since_monotonic` is when it was first raised on the agent's monotonic clock; reports carry
    age_ms computed from it, never a timestamp.
    """

    type: str
    reason: str = ""
    message: str = ""
    section: str = ""
    since_monotonic: float = 0.0


@frozen
class InstanceReport:
    """One VM or container a runtime holds, or a spec instance without one (StatusReport.instances).

    `state`: RUNNING, PAUSED, STOPPED, ERROR or PENDING (waiting: user data, admission)."""

    instance_id: str
    runtime: str
    state: str
    managed: bool
    message: str = ""
    allocation_id: str = ""
    domain: str = ""
    identity_rebound_ref: str = ""  # the identity_rebind_ref bcd installed in the guest (DLV-REB-14)


@frozen
class VolumeStorageReport:
    """StatusReport.volume_storage (DLV-VOL-31..36)."""

    total_bytes: int
    available_bytes: int
    reserved_bytes: int
    committed_bytes: int
    outstanding_bytes: int


@frozen
class InstancesReport:
    """Everything the runtimes hold; `complete` when every runtime was listed without error."""

    instances: tuple[InstanceReport, ...] = ()
    complete: bool = False
    volume_storage: VolumeStorageReport | None = None  # the volume store's space, on hosts that keep one


@frozen
class SectionOutcome:
    """One section's result for one pass."""

    section: str
    state: SectionState
    reason: str = ""
    message: str = ""
    conditions: tuple[Condition, ...] = field(factory=tuple)
    # True when the section changed anything on the host in this pass (used to trigger passes
    # of other sections and to decide on an inventory refresh).
    changed: bool = False
    # The instances section's report for StatusReport.instances (None: this section reports none).
    instances: InstancesReport | None = None


# NodeSpec's protobuf field number of each section: SectionUnsupported's reason (a bare decimal
# string, docs/converge.md, Q-DLV-CONV-01). tests/converge checks these against proto/bcd/v1.
SECTION_FIELD_NUMBERS: dict[str, int] = {
    "host": 1,
    "devices": 2,
    "instances": 3,
    "access": 4,
    "telemetry": 5,
    "daemon": 6,
    "site": 7,
}

# Reasons the runner itself sets.
REASON_HOST_MANAGED_EXTERNALLY = "HostManagedExternally"
CONDITION_SECTION_UNSUPPORTED = "SectionUnsupported"


def _freeze_sections(value: Mapping[str, object | None]) -> Mapping[str, object | None]:
    return MappingProxyType(dict(value))


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@frozen(eq=True, hash=False)
class DesiredSpec:
    """The spec the runner converges: a domain object, independent of the wire.

    The session converts a verified NodeSpec once: `sections` maps a section name of SECTION_ORDER
    to its payload, an opaque object that only that section's converger reads (None, or a missing
    key, for a section that is unset or empty). `unknown_fields` lists NodeSpec field numbers the
    agent does not know (protobuf unknown fields); each is reported UNSUPPORTED. `spec_hash` is
    echoed, never recomputed.
    """

    generation: int
    spec_hash: str
    sections: Mapping[str, object | None] = field(factory=dict, converter=_freeze_sections)
    unknown_fields: tuple[int, ...] = field(default=(), converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        if self.generation < 1:
            raise ValueError(f"DesiredSpec.generation must be at least 1, got {self.generation}")
        unknown = sorted(set(self.sections) - set(SECTION_ORDER))
        if unknown:
            raise ValueError(
                f"DesiredSpec.sections: unknown section names {unknown} (known: {SECTION_ORDER})"
            )
        known_numbers = set(SECTION_FIELD_NUMBERS.values())
        for number in self.unknown_fields:
            if number < 1 or number in known_numbers:
                raise ValueError(
                    f"DesiredSpec.unknown_fields: {number} is not an unknown NodeSpec field number"
                )

    def payload(self, section: str) -> object | None:
        return self.sections.get(section)


@frozen
class SectionStatus:
    """One section's reported state (StatusReport.SectionStatus): DLV-CONV-18."""

    section: str
    state: SectionState
    generation: int
    reason: str = ""
    message: str = ""


@frozen
class ConditionReport:
    """A condition as reported: its age on the monotonic clock, never a timestamp (DLV-CONV-19)."""

    type: str
    reason: str
    message: str
    section: str
    age_ms: int


@frozen(eq=True, hash=False)
class NodeStatus:
    """What the runner publishes after each pass; coalesced latest-wins by the status cell.

    `applied_generation` is the generation of the spec the runner holds (0 before any);
    `observed_generation` the newest generation at which every section settled (DLV-GEN-03).
    `version` increases by one with every publication.
    """

    version: int
    applied_generation: int
    observed_generation: int
    spec_hash: str
    sections: tuple[SectionStatus, ...]
    conditions: tuple[Condition, ...]
    passes: int
    last_pass_monotonic: float
    instances: InstancesReport | None = None  # None: no instances converger ran
    # Under bcd helper: the helper's audit head (seq, sha256) as last read (StatusReport.helper_audit_head).
    audit_head: tuple[int, str] | None = None

    def report_conditions(self, now_monotonic: float) -> tuple[ConditionReport, ...]:
        """The conditions with `age_ms` computed at `now_monotonic` (the time a report is built)."""
        return tuple(
            ConditionReport(
                type=c.type,
                reason=c.reason,
                message=c.message,
                section=c.section,
                age_ms=max(0, int((now_monotonic - c.since_monotonic) * 1000)),
            )
            for c in self.conditions
        )

    def section(self, name: str) -> SectionStatus:
        for s in self.sections:
            if s.section == name:
                return s
        raise KeyError(name)
