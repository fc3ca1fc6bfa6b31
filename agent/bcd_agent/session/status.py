"""The runner's latest-wins NodeStatus as the wire's StatusReport (ages, never timestamps)."""

from __future__ import annotations

from bcd_shared import wire

from bcd_agent.converge.types import SECTION_FIELD_NUMBERS, NodeStatus, SectionState

_STATES = {
    SectionState.CONVERGED: wire.SectionState.CONVERGED,
    SectionState.PROGRESSING: wire.SectionState.PROGRESSING,
    SectionState.FAILED: wire.SectionState.FAILED,
    SectionState.UNSUPPORTED: wire.SectionState.UNSUPPORTED,
}


def section_number(name: str) -> int:
    """A section name's NodeSpec field number; unknown fields are reported under their number."""
    number = SECTION_FIELD_NUMBERS.get(name)
    if number is not None:
        return number
    return int(name) if name.isdigit() else 0


_INSTANCE_STATES = {
    "RUNNING": wire.InstanceState.RUNNING,
    "PAUSED": wire.InstanceState.PAUSED,
    "STOPPED": wire.InstanceState.STOPPED,
    "ERROR": wire.InstanceState.ERROR,
    "PENDING": wire.InstanceState.PENDING,
}


def status_report(status: NodeStatus, now_monotonic: float) -> wire.StatusReport:
    inst = status.instances
    return wire.StatusReport(
        instances=[
            wire.InstanceStatus(
                instance_id=i.instance_id,
                runtime=i.runtime,
                state=_INSTANCE_STATES.get(i.state, wire.InstanceState.UNSPECIFIED),
                managed=i.managed,
                message=i.message,
                allocation_id=i.allocation_id,
                domain=i.domain,
                identity_rebound_ref=i.identity_rebound_ref,
            )
            for i in (inst.instances if inst is not None else ())
        ],
        instances_complete=inst.complete if inst is not None else False,
        volume_storage=(
            wire.VolumeStorage(
                total_bytes=inst.volume_storage.total_bytes,
                available_bytes=inst.volume_storage.available_bytes,
                reserved_bytes=inst.volume_storage.reserved_bytes,
                committed_bytes=inst.volume_storage.committed_bytes,
                outstanding_bytes=inst.volume_storage.outstanding_bytes,
            )
            if inst is not None and inst.volume_storage is not None
            else None
        ),
        observed_generation=status.observed_generation,
        applied_generation=status.applied_generation,
        applied_spec_hash=status.spec_hash,
        sections=[
            wire.SectionStatus(
                section=wire.Section(section_number(s.section)),
                state=_STATES[s.state],
                generation=s.generation,
                reason=s.reason,
                message=s.message,
            )
            for s in status.sections
        ],
        conditions=[
            wire.Condition(
                type=c.type,
                status=wire.ConditionStatus.TRUE,
                reason=c.reason,
                message=f"{c.section}: {c.message}" if c.section else c.message,
                age_ms=c.age_ms,
            )
            for c in status.report_conditions(now_monotonic)
        ],
        helper_audit_head=(
            wire.HelperAuditHead(seq=status.audit_head[0], sha256=status.audit_head[1])
            if status.audit_head is not None
            else None
        ),
    )
