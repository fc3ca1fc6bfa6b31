"""The shapes every config unit shares: plans, steps, issues, the apply context, strict decoding.

Rules (host-config.md):
- A unit's settings are canonical JSON, decoded strictly: an unknown field, a duplicate key, a
  value of the wrong type or trailing data is a TerminalError naming the field and the rule.
- `plan(settings, observed)` is pure: it compares the settings with what the host shows now and
  returns the steps that change only what differs, the issues that remain (terminal, retryable or
  a wait for a reboot) and the conditions the unit reports. A converged unit plans no steps and
  has no issues.
- Steps are frozen data with an `apply(system, actx)`; they run programs as argv lists (never a
  shell), each bounded by the System's 20-minute default.
- Every file bcd writes starts with HEADER (a comment, or a `_comment` key in JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol

from attrs import field, frozen

from bcd_shared.errors import RetryableError, StepError, TerminalError
from bcd_shared.strictjson import unique_keys
from bcd_shared.system import CommandResult, System

STATE_DIR = "/var/lib/bcd-hostconfig"
HEADER_TEXT = "Written by bcd ({unit} unit): local edits are replaced on the next converge pass."
REBOOT_PHRASE = "reboot the node"

IssueKind = Literal["terminal", "retryable", "reboot"]


def header(unit: str, comment: str = "#") -> str:
    """The first line of every file bcd writes (Q-HST-LVL-01: a comment in the file's syntax)."""
    return f"{comment} {HEADER_TEXT.format(unit=unit)}\n"


class RebootRequired(RetryableError):
    """A setting takes effect only after a reboot; bcd never reboots. Retryable."""

    def __init__(self, message: str) -> None:
        if REBOOT_PHRASE not in message:
            message = f"{message}: {REBOOT_PHRASE}"
        super().__init__("RebootRequired", message)


@frozen
class Issue:
    """What keeps a unit from converging after its steps: terminal, retryable or a reboot wait."""

    kind: IssueKind
    message: str

    def to_error(self) -> StepError:
        if self.kind == "terminal":
            return TerminalError("UnitRefused", self.message)
        if self.kind == "reboot":
            return RebootRequired(self.message)
        return RetryableError("UnitNotReady", self.message)


@frozen
class UnitCondition:
    """A condition a unit reports while a fault lasts (FabricManagerDown, MPSDown, ...)."""

    type: str
    reason: str
    message: str


class TokenSource(Protocol):
    """Where k8s-join gets its bootstrap token (never from the spec).

    `bcd node` as root fetches it with a SecretRequest (workflow `host:k8s-join`, step `tokenRef`);
    under bcd helper the node stages it first and the helper reads the staged file.
    """

    def fetch(self, token_ref: str) -> str: ...

    def consumed(self) -> None:
        """The join succeeded: forget the token (remove a staged copy)."""
        ...


PathGuard = Callable[[str], None]


@frozen
class ApplyContext:
    """What steps need besides the System: the root-only path check and the token source."""

    guard: PathGuard | None = None
    tokens: TokenSource | None = None


class Step(Protocol):
    def describe(self) -> str: ...

    def apply(self, system: System, actx: ApplyContext) -> None: ...


@frozen
class Plan:
    steps: tuple[Step, ...] = ()
    issues: tuple[Issue, ...] = ()
    conditions: tuple[UnitCondition, ...] = ()
    # True when applying these steps must end the unit's action for this pass (k8s-join after a
    # package install): the next pass plans the rest.
    stop_after: bool = False

    @property
    def converged(self) -> bool:
        return not self.steps and not self.issues

    @property
    def terminal(self) -> tuple[Issue, ...]:
        return tuple(i for i in self.issues if i.kind == "terminal")


def refuse(message: str) -> TerminalError:
    return TerminalError("InvalidSettings", message)


# ---------------------------------------------------------------------------------------------
# Strict decoding


def _no_constant(name: str) -> Any:
    raise refuse(f"{name} is not a JSON number bcd accepts")


_pairs = unique_keys(lambda k: refuse(f"{k}: appears twice"))


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_no_constant)


def load_object(raw: str | bytes) -> dict[str, Any]:
    """Parse one JSON object and nothing after it (whitespace aside)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as exc:  # a fault of the settings like any other: refused, named
        raise refuse(f"settings are not UTF-8: {exc.reason} at {exc.start}") from None
    try:
        value, end = _DECODER.raw_decode(text.lstrip())
    except json.JSONDecodeError as exc:
        raise refuse(f"settings are not JSON: {exc.msg} at {exc.pos}") from None
    rest = text.lstrip()[end:]
    if rest.strip():
        raise refuse(f"trailing data after the settings object: {rest.strip()[:40]!r}")
    if not isinstance(value, dict):
        raise refuse("settings must be a JSON object")
    return value


class Fields:
    """Reads a settings object field by field; `done()` refuses any field nobody read."""

    def __init__(self, obj: Mapping[str, Any], prefix: str = "") -> None:
        self._obj = obj
        self._seen: set[str] = set()
        self._prefix = prefix

    def _name(self, key: str) -> str:
        return f"{self._prefix}{key}"

    def _get(self, key: str) -> Any:
        self._seen.add(key)
        return self._obj.get(key)

    def has(self, key: str) -> bool:
        return key in self._obj

    def string(self, key: str, *, pattern: str | None = None, max_len: int | None = None) -> str | None:
        v = self._get(key)
        if v is None:
            return None
        if not isinstance(v, str):
            raise refuse(f"{self._name(key)}: must be a string")
        check_string(self._name(key), v, pattern=pattern, max_len=max_len)
        return v

    def choice(self, key: str, choices: Sequence[str]) -> str | None:
        v = self.string(key)
        if v is not None and v not in choices:
            raise refuse(f"{self._name(key)}: {v!r} is not one of {', '.join(choices)}")
        return v

    def boolean(self, key: str) -> bool | None:
        v = self._get(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise refuse(f"{self._name(key)}: must be true or false")
        return v

    def integer(self, key: str, lo: int, hi: int) -> int | None:
        v = self._get(key)
        if v is None:
            return None
        if (
            isinstance(v, bool)
            or not isinstance(v, int | float)
            or (isinstance(v, float) and not v.is_integer())
        ):
            raise refuse(f"{self._name(key)}: must be a whole number")
        n = int(v)
        if not lo <= n <= hi:
            raise refuse(f"{self._name(key)}: {n} is outside {lo} to {hi}")
        return n

    def string_list(
        self, key: str, *, max_items: int, pattern: str | None = None, max_len: int | None = None
    ) -> tuple[str, ...] | None:
        v = self._get(key)
        if v is None:
            return None
        if not isinstance(v, list):
            raise refuse(f"{self._name(key)}: must be a list of strings")
        if len(v) > max_items:
            raise refuse(f"{self._name(key)}: at most {max_items} entries, not {len(v)}")
        out = []
        for i, item in enumerate(v):
            name = f"{self._name(key)}[{i}]"
            if not isinstance(item, str):
                raise refuse(f"{name}: must be a string")
            check_string(name, item, pattern=pattern, max_len=max_len)
            out.append(item)
        return tuple(out)

    def string_map(self, key: str, *, max_items: int) -> tuple[tuple[str, str], ...] | None:
        v = self._get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise refuse(f"{self._name(key)}: must be an object of strings")
        if len(v) > max_items:
            raise refuse(f"{self._name(key)}: at most {max_items} entries, not {len(v)}")
        out = []
        for k, item in v.items():
            if not isinstance(item, str):
                raise refuse(f"{self._name(key)}.{k}: must be a string")
            out.append((k, item))
        return tuple(sorted(out))

    def raw(self, key: str) -> Any:
        return self._get(key)

    def done(self) -> None:
        extra = sorted(set(self._obj) - self._seen)
        if extra:
            raise refuse(f"{self._name(extra[0])}: unknown field")


def check_string(name: str, v: str, *, pattern: str | None = None, max_len: int | None = None) -> None:
    if max_len is not None and len(v) > max_len:
        raise refuse(f"{name}: at most {max_len} characters, not {len(v)}")
    if pattern is not None and not re.fullmatch(pattern, v):
        raise refuse(f"{name}: {v[:80]!r} does not match {pattern}")


# ---------------------------------------------------------------------------------------------
# Steps every unit uses


def _guarded(actx: ApplyContext, path: str) -> None:
    if actx.guard is not None:
        actx.guard(path)


@frozen
class WriteFile:
    path: str
    data: bytes = field(repr=lambda d: f"<{len(d)} bytes>")
    mode: int = 0o644

    def describe(self) -> str:
        return f"write {self.path}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        _guarded(actx, self.path)
        system.write_atomic(self.path, self.data, self.mode)


@frozen
class RemoveFile:
    path: str

    def describe(self) -> str:
        return f"remove {self.path}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        _guarded(actx, self.path)
        system.remove(self.path)


@frozen
class WriteKernel:
    """Write a value to a kernel file (/sys, /proc/sys) in place, through `tee PATH`.

    Kernel files cannot be renamed over; `tee` writes them in place, and on the simulated host its
    fake answers as the kernel would (a short huge page allocation, a governor the driver lacks).
    """

    path: str
    value: str
    verify: bool = False  # read back and fail (retryably) when the kernel kept another value

    def describe(self) -> str:
        return f"set {self.path} to {self.value}"

    def apply(self, system: System, actx: ApplyContext) -> None:
        res = system.run(["tee", system.host_path(self.path).as_posix()], input=self.value.encode() + b"\n")
        if not res.ok:
            raise RetryableError("KernelWrite", f"cannot set {self.path} to {self.value}: {res.describe()}")
        if self.verify:
            now = (system.read_text(self.path) or "").strip()
            if now != self.value:
                raise RetryableError(
                    "KernelWrite", f"{self.path} is {now or 'empty'} after writing {self.value}"
                )


@frozen
class Run:
    """Run one program; a failure is retryable unless `failure` says otherwise."""

    argv: tuple[str, ...]
    failure: IssueKind = "retryable"
    message: str = ""
    ok_stderr: tuple[str, ...] = ()  # stderr fragments that count as done ("not found")
    input: bytes | None = None

    def describe(self) -> str:
        return "run " + " ".join(self.argv)

    def apply(self, system: System, actx: ApplyContext) -> None:
        res = system.run(self.argv, input=self.input)
        check(res, self.failure, self.message, self.ok_stderr)


def check(
    res: CommandResult, failure: IssueKind = "retryable", message: str = "", ok: Sequence[str] = ()
) -> None:
    if res.ok:
        return
    text = (res.stderr + res.stdout).decode(errors="replace")
    if any(frag in text for frag in ok):
        return
    msg = f"{message}: {res.describe()}" if message and failure != "reboot" else (message or res.describe())
    if failure == "terminal":
        raise TerminalError("ToolFailed", msg)
    if failure == "reboot":
        raise RebootRequired(msg)
    raise RetryableError("ToolFailed", msg)


# ---------------------------------------------------------------------------------------------
# Small host readers shared by observers

BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


def has_program(system: System, name: str) -> bool:
    return any(system.exists(f"{d}/{name}") for d in BIN_DIRS)


def systemd_running(system: System) -> bool:
    return system.exists("/run/systemd/system")


def service_active(system: System, unit: str) -> bool:
    res = system.run(["systemctl", "is-active", "--quiet", unit])
    return res.ok


def read_stripped(system: System, path: str) -> str | None:
    text = system.read_text(path)
    return None if text is None else text.strip()


def json_record(unit: str, body: Mapping[str, Any]) -> bytes:
    """A record or config bcd writes as JSON: the header travels as a `_comment` key."""
    doc = {"_comment": HEADER_TEXT.format(unit=unit), **body}
    return (json.dumps(doc, indent=2, sort_keys=False) + "\n").encode()


def read_json_record(system: System, path: str) -> dict[str, Any] | None:
    data = system.read_bytes(path)
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def text_record(unit: str, text: str) -> bytes:
    """A one-value record under STATE_DIR: the header line, then the value."""
    return (header(unit) + text + "\n").encode()


def read_text_record(system: System, path: str) -> str | None:
    text = system.read_text(path)
    if text is None:
        return None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return " ".join(ln.strip() for ln in lines)
