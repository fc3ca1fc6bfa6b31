"""What a section reports after a pass: the contract between sections and the converge runner.

Sections are converged in the seeds' order (host, devices, instances, access, telemetry, daemon,
site). Each section's converger is a pure `plan(desired, observed) -> steps` plus an applier that
runs the steps through an executor (directly as root, or through the helper). A pass ends with one
`SectionOutcome` per section; the runner turns those into SectionStatus and conditions, and
advances observed_generation only when every section is CONVERGED, FAILED or UNSUPPORTED.
"""

from __future__ import annotations

import enum

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
