"""The host `System`: the one interface between bcd's pure planners and the machine.

Planners never touch the host; appliers and observers go through a `System`. Paths given to a
`System` are always absolute host paths ("/etc/cdi/x.json"); the implementation maps them under
its root. Two implementations:

- `LocalSystem(Path("/"))`: the real host (as root directly, or read-only as the agent).
- `LocalSystem(root=DIR, tools=SIM_TOOLS)`: the simulated host, a directory standing for `/`,
  whose programs (nvidia-smi, systemctl, modprobe, nft, virsh, ...) are Python fakes that read and
  change that directory (see bcd_simhost). Every code path above this interface is the
  production path.

Writes are atomic and durable: temporary file, fsync, rename, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Protocol

from attrs import frozen

# Each program a unit runs gets at most 20 minutes (host-config.md).
DEFAULT_TOOL_TIMEOUT_S = 20 * 60


@frozen
class CommandResult:
    """What a program did: its argv, exit status and output."""

    argv: tuple[str, ...]
    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def describe(self) -> str:
        """A one-line account for error messages: program, status and the first stderr line."""
        err = self.stderr.decode(errors="replace").strip().splitlines()
        tail = f": {err[0]}" if err else ""
        return f"{self.argv[0]} exited {self.returncode}{tail}"


class System(Protocol):
    """Files, programs and boot identity of one host (real or simulated)."""

    @property
    def root(self) -> Path:
        """The directory that stands for `/` ("/" on a real host)."""
        ...

    def host_path(self, path: str) -> Path:
        """The real filesystem path of absolute host path `path`."""
        ...

    def read_bytes(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        ...

    def read_text(self, path: str) -> str | None: ...

    def exists(self, path: str) -> bool: ...

    def listdir(self, path: str) -> list[str]:
        """Sorted entry names; [] when the directory does not exist."""
        ...

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write durably: temp file, fsync, rename, fsync of the directory. Creates parents."""
        ...

    def remove(self, path: str) -> bool:
        """Remove a file; True when something was removed."""
        ...

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
    ) -> CommandResult:
        """Run a program as an argv list (never a shell). A missing program is returncode 127."""
        ...

    def boot_id(self) -> str:
        """The kernel's boot id (/proc/sys/kernel/random/boot_id)."""
        ...


# A fake program of the simulated host: (system, argv, stdin) -> result.
FakeTool = Callable[["LocalSystem", Sequence[str], bytes | None], CommandResult]


def _check_abs(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts:
        raise ValueError(f"host path {path!r} must be absolute and free of '..'")
    return p


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(target: Path, data: bytes, mode: int = 0o644) -> None:
    """Temporary file in the same directory, fsync, chmod, rename over, fsync the directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)


class LocalSystem:
    """A host rooted at `root`. With `tools`, programs are looked up there first (simulated host)."""

    def __init__(self, root: Path = Path("/"), tools: Mapping[str, FakeTool] | None = None) -> None:
        self._root = Path(root)
        self._tools = dict(tools or {})

    @property
    def root(self) -> Path:
        return self._root

    @property
    def simulated(self) -> bool:
        return bool(self._tools) or self._root != Path("/")

    def host_path(self, path: str) -> Path:
        p = _check_abs(path)
        if self._root == Path("/"):
            return Path(p)
        return self._root.joinpath(*p.parts[1:])

    def read_bytes(self, path: str) -> bytes | None:
        try:
            return self.host_path(path).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def read_text(self, path: str) -> str | None:
        data = self.read_bytes(path)
        return None if data is None else data.decode("utf-8", errors="replace")

    def exists(self, path: str) -> bool:
        return self.host_path(path).exists()

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self.host_path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def write_atomic(self, path: str, data: bytes, mode: int = 0o644) -> None:
        atomic_write(self.host_path(path), data, mode)

    def remove(self, path: str) -> bool:
        target = self.host_path(path)
        try:
            target.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(target.parent)
        return True

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TOOL_TIMEOUT_S,
        input: bytes | None = None,
        pass_fds: Sequence[int] = (),
    ) -> CommandResult:
        """`pass_fds`: descriptors the program inherits (the helper hands libvirt the files it opened;
        a simulated tool runs in this process and reads them from /proc/self/fd)."""
        if not argv:
            raise ValueError("empty argv")
        args = tuple(argv)
        tool = self._tools.get(os.path.basename(args[0]))
        if tool is not None:
            return tool(self, args, input)
        if self._tools:
            # A simulated host never runs the real machine's programs.
            return CommandResult(args, 127, b"", f"{args[0]}: not found on the simulated host".encode())
        try:
            proc = subprocess.run(
                args, input=input, capture_output=True, timeout=timeout, check=False, pass_fds=tuple(pass_fds)
            )
        except FileNotFoundError:
            return CommandResult(args, 127, b"", f"{args[0]}: command not found".encode())
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout if isinstance(exc.stdout, bytes) else b""
            return CommandResult(args, 124, out, f"{args[0]}: timed out after {timeout:.0f}s".encode())
        return CommandResult(args, proc.returncode, proc.stdout, proc.stderr)

    def boot_id(self) -> str:
        text = self.read_text("/proc/sys/kernel/random/boot_id")
        if text is None:
            raise FileNotFoundError("/proc/sys/kernel/random/boot_id")
        return text.strip()
