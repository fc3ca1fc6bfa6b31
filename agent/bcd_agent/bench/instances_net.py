"""`bcd bench instances`'s network-policy and volume figures (docs/benchmarks.md, docs/instances.md).

- nft_apply_ms_100 / nft_apply_ms_1000: the node's load of the instances' rules for 100 and 1,000
  instances (one NIC each; PRIVATE, NONE and EGRESS in turn, every third with ssh_from_host_only):
  `DirectNft.ruleset` (the host's addresses read by `ip` while the NICs are checked, then the rules
  built), the text staged and `nft -f` through the System, median; nft_f_ms_*: `nft -f FILE` of the
  same text, each right after bcd's load in the same round; nft_ratio (target >= 0.8): the median over
  the 15 rounds of 1,000 instances of each round's nft_f / nft_apply (a pair measured back to back sees the
  same machine load; on a shared machine the load moves between rounds). Where bcd's extra time went
  (docs/instances.md): checking and building the 1,000 NICs' rules (~22 ms of CPU, ~17 now) and the
  `ip` process (now read while the NICs are checked). The loader keeps the last load's NICs checked
  (NicMemo), so the rounds after the first reload known NICs, as the node does when one policy among
  1,000 changes or the integrity check reloads: nft_apply_first_ms_1000 and nft_ratio_first are a
  load by a new loader, in the same run, reported apart (no target). After each load bcd also lists
  the tables once for its reference digest: nft_reference_ms_100 (reported apart).
- integrity_check_ms: one 5-second check of the 100-instance tables (three `nft -j list table` and the
  digest), median (target <= 150).
All of it in a private network namespace: `unshare -n` runs this module as a child, so the machine's
own rules are never touched (needs root and nft).
- volume_create_ms: VolumeStore.create of a sparse 10 GiB volume (file, truncate, record, fsyncs),
  median; each destroyed again.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30


def _nics(n: int) -> dict[str, tuple[Any, ...]]:
    from bcd_shared.netpolicy import NicPolicy

    out: dict[str, tuple[Any, ...]] = {}
    for i in range(n):
        name = f"vm-{i:04d}"
        a, b = divmod(i + 10, 250)
        policy = ("PRIVATE", "NONE", "EGRESS")[i % 3]
        out[name] = (
            NicPolicy(
                name,
                0,
                "br0",
                f"52:54:00:00:{i >> 8:02x}:{i & 255:02x}",
                (f"10.1.{a}.{b}/16", f"fd00::{i + 16:x}/64"),
                policy,
                i % 3 == 0,
            ),
        )
    return out


def _pairs(
    nft: Any, system: Any, nics: list[Any], path: Path, rounds: int
) -> tuple[list[float], list[float]]:
    """`rounds` pairs of (bcd's load, `nft -f` of the same text), each going first in turn, so that the two
    of a pair see the same machine load: the seconds of each."""
    from bcd_shared.netpolicy import load_argv

    bcd: list[float] = []
    plain: list[float] = []

    def ours() -> None:
        t0 = time.perf_counter()
        t, _bridges, _host = nft.ruleset(nics)  # DirectNft.load's own steps up to the listing
        argv, staged = load_argv(t)
        r = system.run(argv, timeout=300)
        os.unlink(staged)
        bcd.append(time.perf_counter() - t0)
        if not r.ok:
            raise RuntimeError(f"nft -f: {r.describe()}")

    def theirs() -> None:
        t0 = time.perf_counter()
        subprocess.run(["nft", "-f", str(path)], check=True, capture_output=True)
        plain.append(time.perf_counter() - t0)

    for i in range(rounds):
        for step in (ours, theirs) if i % 2 == 0 else (theirs, ours):
            step()
    return bcd, plain


def _child() -> dict[str, float]:
    """Runs inside `unshare -n`."""
    from bcd_shared.netpolicy import NicPolicy, build_ruleset
    from bcd_shared.system import LocalSystem

    from bcd_agent.sections.instances.network import DirectNft

    subprocess.run(["ip", "link", "add", "br0", "type", "bridge"], check=True)
    subprocess.run(["ip", "addr", "add", "10.1.0.1/16", "dev", "br0"], check=True)
    subprocess.run(["ip", "link", "set", "br0", "up"], check=True)
    system = LocalSystem()
    nft = DirectNft(system)
    out: dict[str, float] = {}
    ratios: list[float] = []
    tmp = Path(tempfile.mkdtemp(prefix="bcd-bench-nft-"))
    try:
        for n, rounds in ((100, 9), (1000, 15)):
            nics: list[NicPolicy] = [x for v in _nics(n).values() for x in v]
            host = nft.host_addresses(["br0"])
            text = build_ruleset(nics, host)
            path = tmp / f"rules-{n}.nft"
            path.write_text(text)
            if n == 1000:  # a first load: no NIC known yet (reported apart, no target)
                first, first_plain = _pairs(DirectNft(system), system, nics, path, 1)
                out["nft_apply_first_ms_1000"] = first[0] * 1000
                out["nft_ratio_first"] = first_plain[0] / first[0]
            bcd, plain = _pairs(nft, system, nics, path, rounds)
            if n == 1000:
                ratios = [p / b for p, b in zip(plain, bcd, strict=True)]
            out[f"nft_apply_ms_{n}"] = statistics.median(bcd) * 1000
            out[f"nft_f_ms_{n}"] = statistics.median(plain) * 1000
            if n == 100:
                refs: list[float] = []
                checks: list[float] = []
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    nft.load(nics)  # the load again, then the listing that becomes the reference
                    refs.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    if not nft.check():
                        raise RuntimeError("the integrity check failed on untouched tables")
                    checks.append(time.perf_counter() - t0)
                out["nft_reference_ms_100"] = max(
                    0.0, statistics.median(refs) * 1000 - out["nft_apply_ms_100"]
                )
                out["integrity_check_ms"] = statistics.median(checks) * 1000
                out["nft_rules_100"] = float(text.count(" counter "))
        out["nft_ratio"] = statistics.median(ratios)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def nft_figures() -> dict[str, float]:
    """The nft figures, measured in a private network namespace (RuntimeError when that cannot run)."""
    if os.geteuid() != 0 or shutil.which("nft") is None or shutil.which("unshare") is None:
        raise RuntimeError("nft figures need root, nft and unshare")
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, "-m", "bcd_agent.bench.instances_net"],
        capture_output=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nft bench: {proc.stderr.decode(errors='replace')[-500:]}")
    figures: dict[str, float] = json.loads(proc.stdout)
    return figures


def volume_create_ms(base: Path, rounds: int = 15) -> float:
    from bcd_agent.sections.instances.volumes import VolumeSpec, VolumeStore

    store = VolumeStore(str(base / "volumes"))
    store.ensure()
    times: list[float] = []
    for i in range(rounds):
        vol = VolumeSpec(f"bench-{i}", f"bench-{i}", 10 * GIB)
        t0 = time.perf_counter()
        store.create(vol)
        times.append(time.perf_counter() - t0)
        store.destroy(vol.id)
    return statistics.median(times) * 1000


if __name__ == "__main__":
    json.dump(_child(), sys.stdout)
