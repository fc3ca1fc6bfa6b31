"""The node's half of self-update, shared by the `daemon` section and the `daemon.upgrade` kind.

`Upgrader` holds what both need: the helper client (`daemon.swap`, `daemon.confirm`), the staging
directory (`<data_dir>/staging`, which the helper reads by file name only), the version this process
runs, the node's trust bundle (presented to the helper as for host.unit) and the TLS context of the
download. Blocking: call it from a worker thread.

- `confirm_once()`: the running release confirms itself to the helper, once per process. A node that
  started, opened its journal and reached its first converge pass (or ran `daemon.upgrade` again after
  the restart) is healthy enough to keep; one that never gets there is rolled back by root's timer.
  "No swap pending" and "another version pending" are not errors (nothing for this process to confirm).
- `install(target, carrier)`: download the release into staging (sections.daemon.fetch), then
  `daemon.swap` with the signed spec or command that names it (`carrier`); root verifies, swaps and
  restarts `bcd-node.service`. Root's refusals that only a new spec or command can change become
  TerminalError (the section FAILED, the command FAILED with root's reason); `swap-pending` stays
  retryable.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from attrs import frozen
from bcd_shared.errors import HelperRefused, RetryableError, TerminalError

from bcd_agent.sections.daemon.fetch import download
from bcd_agent.sections.daemon.model import ReleaseTarget

log = logging.getLogger("bcd.daemon")

STAGING: Final = "staging"
# Root's refusals that repeat until the spec or command changes.
TERMINAL_REASONS: Final = frozenset(
    {
        "downgrade",
        "stale-generation",
        "version-reused",
        "unordered-version",
        "release-not-in-intent",
        "bad-release-signature",
        "artifact-mismatch",
        "bad-manifest",
        "bad-artifact",
        "wrong-node",
        "bad-intent",
        "expired-intent",
        "intent-replayed",
        "freshness-required",
        "intent-unverifiable",
        "intent-required",
        "release-failed",
    }
)


@frozen
class Carrier:
    """The signed spec or command that names the release: which, its exact bytes, its signature and
    the signer chain (the same worker signs the release)."""

    kind: str  # "spec" | "command"
    body: bytes
    signature: bytes
    chain: tuple[bytes, ...]


class Upgrader:
    def __init__(
        self,
        helper: Any,
        data_dir: str | Path,
        running_version: str,
        *,
        trust_bundle: Callable[[], bytes | None] = lambda: None,
        ssl_context: Callable[[], ssl.SSLContext | None] = lambda: None,
        confirm_timeout_s: int = 600,
    ) -> None:
        self.helper = helper
        self.staging = Path(data_dir) / STAGING
        self.running_version = running_version
        self.trust_bundle = trust_bundle
        self.ssl_context = ssl_context
        self.confirm_timeout_s = confirm_timeout_s
        self.confirmed: dict[str, Any] | None = None
        self._confirm_tried = False

    def confirm_once(self) -> dict[str, Any] | None:
        """Confirm the running release to root, once per process; root's answer, or None."""
        if self._confirm_tried:
            return self.confirmed
        try:
            answer = self.helper.daemon_confirm(self.running_version)
        except HelperRefused as exc:
            if exc.reason in ("no-pending-swap", "version-mismatch"):
                self._confirm_tried = True
                return None
            raise
        self._confirm_tried = True
        self.confirmed = dict(answer)
        log.warning("daemon: release %s confirmed to the helper", self.running_version)
        return self.confirmed

    def install(self, target: ReleaseTarget, carrier: Carrier) -> dict[str, Any]:
        """Download, then ask root to verify and swap; root's answer (root restarts the node)."""
        if not carrier.signature:
            raise TerminalError(
                "UnsignedRelease", f"the {carrier.kind} naming release {target.version} is not signed"
            )
        download(target.url, target.sha256, self.staging, target.artifact_name, context=self.ssl_context())
        try:
            answer = self.helper.daemon_swap(
                version=target.version,
                url=target.url,
                sha256=target.sha256,
                signature=target.signature,
                chain=carrier.chain,
                artifact=target.artifact_name,
                trust_bundle=self.trust_bundle(),
                confirm_timeout_s=self.confirm_timeout_s,
                rollback=target.rollback,
                spec=(carrier.body, carrier.signature) if carrier.kind == "spec" else None,
                command=(carrier.body, carrier.signature) if carrier.kind == "command" else None,
            )
        except HelperRefused as exc:
            if exc.reason in TERMINAL_REASONS:
                raise TerminalError(exc.reason, exc.message) from None
            raise
        log.warning(
            "daemon: release %s swapped in by the helper (was %s); bcd-node restarts",
            target.version,
            self.running_version,
        )
        return dict(answer)


def no_carrier(what: str) -> RetryableError:
    return RetryableError("SignedSpecMissing", f"no signed {what} names the release yet")
