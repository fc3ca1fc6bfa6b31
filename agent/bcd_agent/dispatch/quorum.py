"""The quorum ledger: what the destructive-batch quorum must remember across restarts (DLV-QRM-03..05).

Two records, kept in one small JSON file in `data_dir` (`quorum-ledger.json`), rewritten atomically and
fsynced (file and directory) before the command they admit is journaled `accepted`:

- `unbatched`: `[host_time, command_id]` of every destructive command admitted without a `batch_id`
  within the last hour of the host's own clock. A command id counts once, so the re-execution of a
  retry-safe command after a restart does not use the allowance again. Entries stamped in the future
  (the host clock went back) keep counting until they are an hour old: the allowance never grows
  because a clock moved.
- `leaves`: every batch leaf that admitted a command, with that command's id and, when the approval
  carries one, its expiry in server time. A leaf admits one command id only ("each batch leaf runs at
  most once"); the same id may pass again (a redelivered or re-executed command is the same run).
  A leaf is forgotten a day after its approval expired (an expired approval admits nothing anyway);
  leaves of approvals without an expiry are kept, up to MAX_LEAVES, beyond which new leaves are refused.

The file is checked strictly when loaded. A corrupt ledger raises `LedgerCorrupt`: the quorum's memory
is never silently reset (the dispatcher does not start; the operator moves the file aside knowingly).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attrs import frozen
from bcd_shared.system import atomic_write

LEDGER_FILE = "quorum-ledger.json"
WINDOW_S = 3600.0
LEAF_GRACE_S = 24 * 3600.0
MAX_LEAVES = 100_000
_VERSION = 1


class LedgerCorrupt(Exception):
    """The ledger file exists but is not a valid ledger; names the file and the rule."""


class LedgerFull(Exception):
    """MAX_LEAVES unexpired leaves are recorded: no new leaf is admitted."""


@frozen
class LeafRecord:
    command_id: str
    recorded_at: float  # host time
    expires_at: float | None  # server time (seconds since the epoch) of the approval's expiry


class QuorumLedger:
    """The persisted unbatched allowance and used batch leaves of one data_dir."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._unbatched: list[tuple[float, str]] = []
        self._leaves: dict[str, LeafRecord] = {}

    @classmethod
    def open(cls, data_dir: Path) -> QuorumLedger:
        ledger = cls(data_dir / LEDGER_FILE)
        ledger._load()
        return ledger

    @property
    def path(self) -> Path:
        return self._path

    # --- reads (pure) ---------------------------------------------------------------------------------

    def unbatched_in_window(self, host_now: float) -> int:
        """Destructive unbatched commands admitted within the rolling hour ending at `host_now`."""
        return sum(1 for t, _ in self._unbatched if t > host_now - WINDOW_S)

    def unbatched_admits(self, command_id: str, host_now: float, allowance: int) -> bool:
        """Would an unbatched destructive `command_id` be admitted now, with `allowance` per hour (the trust
        bundle's `unbatched_destructive_per_hour`)? A command already counted in the window passes."""
        if any(cid == command_id for t, cid in self._unbatched if t > host_now - WINDOW_S):
            return True
        return self.unbatched_in_window(host_now) < allowance

    def leaf_owner(self, leaf: str) -> str | None:
        """The command id a batch leaf already admitted, or None."""
        rec = self._leaves.get(leaf)
        return rec.command_id if rec is not None else None

    # --- writes (durable when they return) -------------------------------------------------------------

    def record_unbatched(self, command_id: str, host_now: float) -> None:
        live = [(t, cid) for t, cid in self._unbatched if t > host_now - WINDOW_S]
        if any(cid == command_id for _, cid in live):
            return
        self._unbatched = [*live, (host_now, command_id)]
        self._save()

    def record_leaf(
        self, leaf: str, command_id: str, host_now: float, server_now: float, expires_at: float | None
    ) -> None:
        owner = self.leaf_owner(leaf)
        if owner == command_id:
            return
        if owner is not None:
            raise ValueError(f"batch leaf {leaf} already admitted command {owner}")
        self._leaves = {
            k: r
            for k, r in self._leaves.items()
            if r.expires_at is None or r.expires_at + LEAF_GRACE_S > server_now
        }
        if len(self._leaves) >= MAX_LEAVES:
            raise LedgerFull(f"{self._path}: {MAX_LEAVES} batch leaves recorded")
        self._leaves[leaf] = LeafRecord(command_id, host_now, expires_at)
        self._save()

    # --- the file ----------------------------------------------------------------------------------------

    def _save(self) -> None:
        doc = {
            "version": _VERSION,
            "unbatched": [[t, cid] for t, cid in self._unbatched],
            "leaves": {
                leaf: {"command_id": r.command_id, "recorded_at": r.recorded_at, "expires_at": r.expires_at}
                for leaf, r in sorted(self._leaves.items())
            },
        }
        atomic_write(self._path, json.dumps(doc, sort_keys=True).encode(), mode=0o600)

    def _load(self) -> None:
        try:
            raw = self._path.read_bytes()
        except FileNotFoundError:
            return
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LedgerCorrupt(f"{self._path}: not JSON ({exc})") from None
        self._unbatched, self._leaves = _parse(self._path, doc)


def _fail(path: Path, where: str, rule: str) -> LedgerCorrupt:
    return LedgerCorrupt(f"{path}: {where}: {rule}")


def _number(path: Path, where: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _fail(path, where, "must be a number")
    return float(v)


def _parse(path: Path, doc: Any) -> tuple[list[tuple[float, str]], dict[str, LeafRecord]]:
    if not isinstance(doc, dict) or set(doc) != {"version", "unbatched", "leaves"}:
        raise _fail(path, "document", "must be an object with exactly version, unbatched, leaves")
    if doc["version"] != _VERSION:
        raise _fail(path, "version", f"must be {_VERSION}")
    unbatched: list[tuple[float, str]] = []
    if not isinstance(doc["unbatched"], list):
        raise _fail(path, "unbatched", "must be a list")
    for i, item in enumerate(doc["unbatched"]):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[1], str):
            raise _fail(path, f"unbatched[{i}]", "must be [host_time, command_id]")
        unbatched.append((_number(path, f"unbatched[{i}][0]", item[0]), item[1]))
    leaves: dict[str, LeafRecord] = {}
    if not isinstance(doc["leaves"], dict):
        raise _fail(path, "leaves", "must be an object")
    for leaf, rec in doc["leaves"].items():
        where = f"leaves[{leaf!r}]"
        if not isinstance(rec, dict) or set(rec) != {"command_id", "recorded_at", "expires_at"}:
            raise _fail(path, where, "must have exactly command_id, recorded_at, expires_at")
        if not isinstance(rec["command_id"], str) or not rec["command_id"]:
            raise _fail(path, f"{where}.command_id", "must be a non-empty string")
        exp = rec["expires_at"]
        leaves[leaf] = LeafRecord(
            command_id=rec["command_id"],
            recorded_at=_number(path, f"{where}.recorded_at", rec["recorded_at"]),
            expires_at=None if exp is None else _number(path, f"{where}.expires_at", exp),
        )
    return unbatched, leaves
