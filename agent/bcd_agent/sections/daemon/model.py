"""The daemon section's model and its pure planner (no I/O, no clock).

`ReleaseTarget` is the self-update target of NodeSpec.daemon or of a `daemon.upgrade` payload (version,
URL, SHA-256, the release signature, the rollback flag; DLV-SPEC-08). `plan(target, observed)` says what
the node does next:

| Observed                                                    | Steps                                   |
| ----------------------------------------------------------- | --------------------------------------- |
| no target (the section is empty)                            | none: converged                         |
| the running release is the target's version                 | none: converged                         |
| the staged artifact is missing or not the signed SHA-256    | download, swap, restart                 |
| the staged artifact is the signed one                       | swap, restart                           |

Confirmation is not a step of a pass: a release confirms itself once per process (sections.daemon.section).
"""

from __future__ import annotations

import enum
import re
from typing import Final

from attrs import frozen
from bcd_shared import wire
from bcd_shared.errors import TerminalError
from bcd_shared.release import SHA256_RE, URL_RE, VERSION_RE

ARTIFACT_PREFIX: Final = "bcd-"
_SAFE_NAME: Final = re.compile(r"[^A-Za-z0-9._+~-]")


@frozen
class ReleaseTarget:
    version: str
    url: str
    sha256: str
    signature: bytes
    rollback: bool = False

    @property
    def artifact_name(self) -> str:
        """The file name in the staging directory: one per version (the helper takes names only)."""
        return ARTIFACT_PREFIX + _SAFE_NAME.sub("_", self.version)


def target_from_wire(section: wire.DaemonSection | wire.DaemonUpgradeRequest | None) -> ReleaseTarget | None:
    """The target, None for an empty section; TerminalError naming the field for a bad one (a new
    spec is the only fix)."""
    if section is None or (not section.version and not section.url and not section.sha256):
        return None
    where = "daemon" if isinstance(section, wire.DaemonSection) else "payload"
    if not VERSION_RE.fullmatch(section.version):
        raise TerminalError(
            "InvalidRelease", f"{where}.version: {section.version[:80]!r} is not a release version"
        )
    if not URL_RE.fullmatch(section.url):
        raise TerminalError("InvalidRelease", f"{where}.url: {section.url[:80]!r} is not an https URL")
    if not SHA256_RE.fullmatch(section.sha256):
        raise TerminalError("InvalidRelease", f"{where}.sha256: must be 64 lowercase hex digits")
    if len(section.signature) != 64:
        raise TerminalError("InvalidRelease", f"{where}.signature: must be a 64-byte Ed25519 signature")
    return ReleaseTarget(
        section.version, section.url, section.sha256, bytes(section.signature), bool(section.rollback)
    )


@frozen
class Observed:
    running_version: str
    staged_sha256: str | None  # the SHA-256 of the staged artifact for the target, None when absent


class Step(enum.Enum):
    DOWNLOAD = "download"
    SWAP = "swap"
    RESTART = "restart"


def plan(target: ReleaseTarget | None, observed: Observed) -> tuple[Step, ...]:
    if target is None or target.version == observed.running_version:
        return ()
    if observed.staged_sha256 != target.sha256:
        return (Step.DOWNLOAD, Step.SWAP, Step.RESTART)
    return (Step.SWAP, Step.RESTART)
