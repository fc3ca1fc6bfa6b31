"""The simulated host's kernel log, as journald keeps it: `<root>/var/lib/bcd-sim/journal/kernel.jsonl`.

One entry a line, each as `journalctl -o json` prints it (systemd 252: `__CURSOR`, `__REALTIME_TIMESTAMP`,
`__MONOTONIC_TIMESTAMP`, `_BOOT_ID` without dashes, `_TRANSPORT`, `SYSLOG_FACILITY`, `PRIORITY`,
`SYSLOG_IDENTIFIER`, `MESSAGE`; every value a string). The fake `journalctl -o json` (journalctl.py)
reads it. `kernel_line(root, message)` appends what the kernel would log (facility 0, transport
kernel, this boot); `injected_line` what a root process writing /dev/kmsg would get (facility LOG_USER):
`bcd sim` and the XID tests use them to raise NVIDIA XIDs (`xid_message`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

KERNEL_LOG = "/var/lib/bcd-sim/journal/kernel.jsonl"


def _path(root: Path) -> Path:
    return Path(root) / KERNEL_LOG.lstrip("/")


def boot_id(root: Path) -> str:
    return (Path(root) / "proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")


def entries(root: Path) -> list[dict[str, Any]]:
    try:
        text = _path(root).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            out.append(doc)
    return out


def _append(root: Path, fields: dict[str, str]) -> dict[str, str]:
    path = _path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(entries(root)) + 1
    boot = fields.get("_BOOT_ID") or boot_id(root)
    now = time.time()
    entry = {
        "__CURSOR": f"s=5b1d0c6a;i={n:x};b={boot}",
        "__REALTIME_TIMESTAMP": str(int(now * 1e6)),
        "__MONOTONIC_TIMESTAMP": str(int(time.monotonic() * 1e6)),
        "_BOOT_ID": boot,
        **fields,
    }
    with path.open("a") as f:
        f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return entry


def kernel_line(root: Path, message: str, *, boot: str = "") -> dict[str, str]:
    """A line the kernel logged (printk: facility 0, journald's transport `kernel`)."""
    fields = {"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0", "PRIORITY": "4", "SYSLOG_IDENTIFIER": "kernel"}
    if boot:
        fields["_BOOT_ID"] = boot
    return _append(root, {**fields, "MESSAGE": message})


def injected_line(root: Path, message: str) -> dict[str, str]:
    """A line root wrote to /dev/kmsg: facility LOG_USER (1) from the kernel, transport kernel."""
    fields = {"_TRANSPORT": "kernel", "SYSLOG_FACILITY": "1", "PRIORITY": "4", "SYSLOG_IDENTIFIER": "evil"}
    return _append(root, {**fields, "MESSAGE": message})


def xid_message(bus_id: str, code: int, text: str = "GPU has fallen off the bus.") -> str:
    """NVRM's line for an XID on the GPU at nvidia-smi's `bus_id` (00000000:3A:00.0), as driver 550+
    prints it when no process is to blame (open-gpu-kernel-modules, kernel_rc.c krcReportXid)."""
    domain, bus, rest = bus_id.split(":")
    device = rest.split(".")[0]
    where = f"{int(domain, 16):04x}:{bus.lower()}:{device.lower()}"
    return f"NVRM: Xid (PCI:{where}): {code}, pid='<unknown>', name=<unknown>, {text}"


def main(argv: list[str] | None = None) -> int:
    """`python -m bcd_simhost.kernellog DIR GPU_INDEX XID [TEXT]`: the kernel of the simulated host at DIR
    logs XID on that GPU (a running `bcd sim --root DIR` raises XidError within its poll interval)."""
    import argparse

    from bcd_simhost.gpus import read_state_file

    parser = argparse.ArgumentParser(prog="python -m bcd_simhost.kernellog", description=main.__doc__)
    parser.add_argument("root", type=Path, help="the simulated host's directory (bcd sim --root)")
    parser.add_argument("gpu", type=int, help="the GPU's index (nvidia-smi -L)")
    parser.add_argument("xid", type=int, help="the XID code, e.g. 79")
    parser.add_argument("text", nargs="?", default="GPU has fallen off the bus.", help="the message's tail")
    args = parser.parse_args(argv)
    try:
        gpus = read_state_file(args.root)["gpus"]
    except OSError as exc:
        parser.error(f"root: no simulated host there ({exc.strerror})")
    if not 0 <= args.gpu < len(gpus):
        parser.error(f"gpu: the simulated host has GPUs 0..{len(gpus) - 1}")
    if not 0 <= args.xid <= 99999:
        parser.error("xid: a code from 0 to 99999")
    entry = kernel_line(args.root, xid_message(gpus[args.gpu]["bus_id"], args.xid, args.text))
    print(entry["MESSAGE"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
