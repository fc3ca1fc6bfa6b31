"""Root's memory of the signed destructive commands it acted on: a replay is refused.

A signed command stays valid until its `not_after`, so without a memory a compromised node could hand root
the same signed `gpu.reset` or `node.reboot` again and again until then. Root remembers what it acted on,
in its own file, durably and bounded:

- an entry is (command id, op, target, not_after): `gpu.reset` remembers each GPU it resets under the
  command (the node resets a command's GPUs one call each, with the same command), `node.reboot` the
  command alone (target "");
- it is written before the effect (atomic write, file and directory fsynced, root-only rule), after
  every other check passed: a refusal (a busy GPU, an expired command) remembers nothing, so the node can
  bring the same command again once the GPU is free; an effect that fails (nvidia-smi's error) is not
  retried under the same command: the control plane issues a new one;
- an entry is dropped once its `not_after` has passed by root's clock (the command is refused as expired
  from then on anyway);
- at most MAX_USED entries not yet expired: past that a new command is refused (`command-memory-full`),
  fail closed. Only the control plane can mint commands, so it takes MAX_USED destructive commands still
  valid at once to get there;
- a command without an id cannot be remembered and is refused (`bad-command`); the file unreadable or
  not in its format refuses every destructive command (`command-memory`) until root repairs or removes
  it (removing it forgets the commands still valid: a replay of them is then possible until their
  `not_after`).

The file: `/var/lib/bcd-hostconfig/helper-commands.json`, 0600:
{"format": 1, "used": [{"id", "op", "target", "not_after_ms"}, ...]}, oldest first.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from attrs import frozen
from bcd_shared.rootpath import RootPathRefused, read_root_only, write_root_only

from bcd_helper.ops.base import Failed, Refused

USED_PATH: Final = "/var/lib/bcd-hostconfig/helper-commands.json"
USED_FORMAT: Final = 1
MAX_USED: Final = 1024
MAX_ID: Final = 128
MAX_FILE: Final = MAX_USED * 512


@frozen
class Used:
    id: str
    op: str
    target: str
    not_after_ms: int


def _decode(data: bytes) -> list[Used]:
    """Strict: exact keys and JSON types; raises ValueError naming the field."""
    doc = json.loads(data)
    if not isinstance(doc, dict) or set(doc) != {"format", "used"}:
        raise ValueError('expected {"format", "used"}')
    if doc["format"] != USED_FORMAT:
        raise ValueError(f"format {doc['format']!r} is not {USED_FORMAT}")
    if not isinstance(doc["used"], list):
        raise ValueError("used: expected a list")
    out = []
    for i, item in enumerate(doc["used"]):
        if (
            not isinstance(item, dict)
            or set(item) != {"id", "op", "target", "not_after_ms"}
            or not all(type(item[k]) is str for k in ("id", "op", "target"))
            or type(item["not_after_ms"]) is not int
        ):
            raise ValueError(f"used[{i}]: expected {{id, op, target, not_after_ms}}")
        out.append(Used(item["id"], item["op"], item["target"], item["not_after_ms"]))
    return out


def _encode(used: Sequence[Used]) -> bytes:
    doc = {
        "format": USED_FORMAT,
        "used": [{"id": u.id, "op": u.op, "target": u.target, "not_after_ms": u.not_after_ms} for u in used],
    }
    return (json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n").encode()


class UsedCommands:
    """The memory of one helper process (its lock makes check-and-remember one step)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()

    def _load(self, op: str) -> list[Used]:
        try:
            data = read_root_only(self.root, USED_PATH, MAX_FILE)
        except RootPathRefused as exc:
            raise Failed("command-memory", f"{op}: {USED_PATH}: {exc}") from None
        if data is None:
            return []
        try:
            return _decode(data)
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            raise Failed(
                "command-memory",
                f"{op}: root's memory of used commands {USED_PATH} cannot be read ({exc}): "
                "no destructive command is acted on until root repairs or removes it",
            ) from None

    def check(self, op: str, command_id: str, targets: Sequence[str], now_ms: int) -> None:
        """Refuse (`command-replayed`) when root acted on this command for any of `targets` already."""
        with self._lock:
            self._refuse_replay(op, command_id, targets, self._load(op), now_ms)

    def remember(
        self, op: str, command_id: str, targets: Sequence[str], not_after_ms: int, now_ms: int
    ) -> None:
        """Record the command for `targets`, durably, before the effect; refuses a replay (checked again
        under the lock) and a full memory."""
        with self._lock:
            used = [u for u in self._load(op) if u.not_after_ms > now_ms]
            self._refuse_replay(op, command_id, targets, used, now_ms)
            if len(used) + len(targets) > MAX_USED:
                soonest = min(u.not_after_ms for u in used) if used else now_ms
                raise Refused(
                    "command-memory-full",
                    f"{op}: root remembers {len(used)} destructive commands still valid "
                    f"(at most {MAX_USED}); the first expires in {max(0, soonest - now_ms) // 1000} s",
                )
            used += [Used(command_id, op, t, not_after_ms) for t in targets]
            try:
                write_root_only(self.root, USED_PATH, _encode(used), 0o600)
            except RootPathRefused as exc:
                raise Failed("command-memory", f"{op}: {USED_PATH}: {exc}") from None

    def forget(self, op: str, command_id: str, now_ms: int) -> None:
        """Drop what `remember` recorded for the command when its effect did not start (daemon.swap's swap
        failed with the previous release still installed): a retry-safe command may come again."""
        with self._lock:
            used = [u for u in self._load(op) if u.not_after_ms > now_ms]
            kept = [u for u in used if not (u.id == command_id and u.op == op)]
            if kept != used:
                try:
                    write_root_only(self.root, USED_PATH, _encode(kept), 0o600)
                except RootPathRefused as exc:
                    raise Failed("command-memory", f"{op}: {USED_PATH}: {exc}") from None

    @staticmethod
    def _refuse_replay(
        op: str, command_id: str, targets: Sequence[str], used: list[Used], now_ms: int
    ) -> None:
        if not command_id or len(command_id) > MAX_ID:
            raise Refused(
                "bad-command", f"{op}: the signed command has no id (or one over {MAX_ID} characters)"
            )
        done = {u.target for u in used if u.id == command_id and u.op == op and u.not_after_ms > now_ms}
        again = [t for t in targets if t in done]
        if again:
            what = f" for {', '.join(again)}" if any(again) else ""
            raise Refused(
                "command-replayed",
                f"{op}: root acted on the signed command {command_id!r}{what} already: "
                "a command is acted on once (root remembers it until its not_after)",
            )
