"""The `access` section: sshd's trusted user CA keys, this node's principals, the KRL, the exec-ticket JWKS.

delivery.md "Break-glass SSH and tunnel keys" (DLV-ACC-01..12, DLV-PRIV-07); design in docs/access.md.
The files are rendered and planned by bcd_shared.access (`render`, the pure `plan(desired, observed)`),
the one place root's helper uses too, so a node as root and the helper write the same bytes.

- Checks again (DLV-ACC-12): a section breaking DLV-ACC-09..11 fails the section terminally
  (`InvalidAccess`); the session already refused the spec that carried it.
- Executors: `DirectExecutor` (bcd node as root, or the simulated host) observes bcd's sshd files through
  the System, plans and applies the steps (write through the root-only rule as root, reload sshd with
  systemctl when the drop-in changed); `HelperExecutor` (bcd node unprivileged) sends one
  `access.apply` with the signed spec the node keeps: root renders, plans and applies itself, the node
  never sends sshd text (DLV-PRIV-07, issue 9 item 1).
- An account of uid 0 gets no principals file unless `[helper] root_principals = true` (as root: the
  node's config; under the helper: root's).
- The exec-ticket JWKS is taken anew on every pass, even when no file changes (DLV-ACC-08), and kept
  for the tunnel code (`current_jwks`, DLV-ACC-07).
- `changed` when a file changed; the outcome message names what was done. A helper refusal is retried
  (DLV-PRIV-06), except those only root's config or a new spec can change (`access-unsigned`,
  `root-principal`, `invalid-access`): FAILED, so observed_generation is not held back.
"""

from __future__ import annotations

import pwd
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from attrs import frozen
from bcd_shared import access as acc
from bcd_shared.errors import HelperRefused, RetryableError, TerminalError
from bcd_shared.system import System
from bcd_shared.units.rootonly import for_root

from bcd_agent.converge.section import Observation, PassContext
from bcd_agent.converge.types import SectionOutcome, SectionState

SECTION = "access"
SSHD_UNITS = ("ssh.service", "sshd.service")
# Helper refusals that only root's config or a new spec can change: the section fails terminally instead
# of holding back observed_generation forever (every other helper error is retried, DLV-PRIV-06).
TERMINAL_REFUSALS = frozenset({"access-unsigned", "root-principal", "invalid-access"})


@frozen
class AccessSpec:
    """The domain form of NodeSpec.access."""

    jwks: str = ""
    ca_keys: tuple[str, ...] = ()
    principals: tuple[str, ...] = ()
    serials: tuple[int, ...] = ()

    @classmethod
    def of(cls, desired: object | None) -> AccessSpec:
        if desired is None:
            return cls()
        if isinstance(desired, AccessSpec):
            return desired
        return cls(
            str(getattr(desired, "exec_ticket_jwks", "")),
            tuple(getattr(desired, "ssh_ca_keys", ())),
            tuple(getattr(desired, "principals", ())),
            tuple(int(s) for s in getattr(desired, "revoked_serials", ())),
        )

    @property
    def empty(self) -> bool:
        return not (self.jwks or self.ca_keys or self.principals or self.serials)


def render(spec: AccessSpec, node_id: str) -> acc.AccessFiles:
    """The files (raises TerminalError InvalidAccess for DLV-ACC-09..11: checked again, DLV-ACC-12)."""
    try:
        return acc.render(spec.ca_keys, spec.principals, spec.serials, node_id)
    except acc.AccessInvalid as exc:
        raise TerminalError("InvalidAccess", str(exc)) from None


class AccessExecutor(Protocol):
    def converge(self, spec: AccessSpec, node_id: str) -> tuple[bool, str]:
        """Bring the files to `spec`; (changed, what was done). Raises StepError."""
        ...


def _uid_of(system: System, account: str) -> int | None:
    if str(system.root) == "/":
        try:
            return pwd.getpwnam(account).pw_uid
        except KeyError:
            return None
    for line in (system.read_text("/etc/passwd") or "").splitlines():
        fields = line.split(":")
        if len(fields) >= 3 and fields[0] == account and fields[2].isdigit():
            return int(fields[2])
    return None


def observe(system: System) -> acc.Observed:
    """bcd's sshd files as they are (read through the System)."""
    accounts = [n for n in system.listdir(acc.SSHD_PRINCIPALS) if acc.ACCOUNT_RE.fullmatch(n)]
    files: dict[str, bytes] = {}
    for path in acc.managed_paths(accounts):
        data = system.read_bytes(path)
        if data is not None:
            files[path] = data
    return acc.Observed(files)


@frozen
class DirectExecutor:
    """bcd node as root (or the simulated host): observe, plan, apply through the System."""

    system: System
    root_principals: bool = False

    def converge(self, spec: AccessSpec, node_id: str) -> tuple[bool, str]:
        desired = render(spec, node_id)
        system = for_root(self.system)  # as root, every write and removal follows the root-only rule
        if not self.root_principals:
            for account in desired.accounts:
                if _uid_of(self.system, account) == 0:
                    raise TerminalError(
                        "RootPrincipal",
                        f"account {account!r} has uid 0: no principals file for it unless "
                        "[helper] root_principals = true",
                    )
        steps = acc.plan(desired, observe(system))
        done: list[str] = []
        for step in steps:
            if isinstance(step, acc.Write):
                system.write_atomic(step.path, step.data, acc.FILE_MODE)
                done.append(f"write {step.path}")
            elif isinstance(step, acc.Remove):
                if system.remove(step.path):
                    done.append(f"remove {step.path}")
            else:
                try:
                    done.append(self._reload(system))
                except RetryableError:
                    # sshd did not take the new drop-in: take it away again, so the next pass sees the change
                    # and reloads again (a reload happens only on a drop-in change, DLV-ACC-05).
                    if desired.dropin is not None:
                        system.remove(acc.SSHD_DROPIN)
                    raise
        return bool(done), "; ".join(d for d in done if d)

    def _reload(self, system: System) -> str:
        for unit in SSHD_UNITS:
            if system.run(["systemctl", "is-active", "--quiet", unit], timeout=30).ok:
                result = system.run(["systemctl", "reload", unit], timeout=60)
                if not result.ok:
                    raise RetryableError("SshdReload", f"systemctl reload {unit}: {result.describe()}")
                return f"reload {unit}"
        return ""


@frozen
class HelperExecutor:
    """bcd node unprivileged: one `access.apply` with the kept signed spec; root renders and applies."""

    client: Any  # HelperClient: access_apply(intent)
    intent: Callable[[], Mapping[str, Any] | None]
    system: System | None = None  # to read the files (0644) and skip root when they already match

    def converge(self, spec: AccessSpec, node_id: str) -> tuple[bool, str]:
        desired = render(
            spec, node_id
        )  # the node's own check first (DLV-ACC-12): never ask root for a bad one
        if self.system is not None and not acc.plan(desired, observe(self.system)):
            return False, ""  # root would render the same bytes: nothing to ask (no audit line every pass)
        try:
            result = self.client.access_apply(self.intent())  # HelperRefused: retryable (DLV-PRIV-06)
        except HelperRefused as exc:
            if exc.reason in TERMINAL_REFUSALS:
                raise TerminalError(exc.reason, exc.message) from None
            raise
        written = [str(p) for p in result.get("written", [])]
        removed = [str(p) for p in result.get("removed", [])]
        done = [f"write {p}" for p in written] + [f"remove {p}" for p in removed]
        if result.get("reloaded"):
            done.append(f"reload {result['reloaded']}")
        return bool(written or removed), "; ".join(done)


class AccessSection:
    """The converge runner's `access` section (see the module)."""

    name = SECTION

    def __init__(self, executor: AccessExecutor, node_id: str, *, data_dir: str | Path | None = None) -> None:
        self.executor = executor
        self.node_id = node_id
        self.data_dir = data_dir
        self._jwks = ""

    def current_jwks(self) -> str:
        """The exec-ticket JWKS of the newest pass (DLV-ACC-07): what every OpenTunnel is verified against."""
        return self._jwks

    def is_empty(self, desired: object | None) -> bool:
        return AccessSpec.of(desired).empty

    def converge(self, desired: object | None, observation: Observation, ctx: PassContext) -> SectionOutcome:
        spec = AccessSpec.of(desired)
        self._jwks = spec.jwks  # every pass, even when no file changes (DLV-ACC-08)
        changed, what = self.executor.converge(spec, self.node_id)
        return SectionOutcome(SECTION, SectionState.CONVERGED, message=what, changed=changed)
