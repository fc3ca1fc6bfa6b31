"""A fake `dcgmi` for the simulated host: `dcgmi diag -r LEVEL -j [-i IDS]` over the GPU state (gpus.json).

The document is DCGM 4.x's JSON output. Where the shape comes from: NVIDIA DCGM's nvvs `JsonOutput`
(the per-test `results` with `status` and `warnings: [{warning, error_id, error_category, error_severity}]`,
`info` lists, software tests reported once for all GPUs) and a `dcgmi diag -r 1 -j` document from DCGM
4.2.3 on real hardware quoted in a public project's test fixtures: the top-level object holds
`"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name", "results": [{"entity_group":
"GPU", "entity_group_id": 1, "entity_id", "status", "warnings"?}], "test_summary": {"status", "info"?}}]}]}`,
then `entity_groups` (`[{"entity_group": "GPU", "entity_group_id": 1, "entities": [{"entity_id",
"device_id", "serial_num"}]}]`) and `metadata` (`{"Driver Version Detected", "version"}`). Statuses are
capitalised (`Pass`, `Fail`, `Warn`, `Skip`). The tests by run level follow DCGM 4's plugin names
(level 1 `software`; 2 adds `pcie` and `memory`; 3 adds `memory_bandwidth`, `diagnostic`,
`targeted_stress`, `targeted_power`; 4 adds `pulse_test` and `memtest`).

Simulated findings: a GPU with uncorrectable volatile ECC errors or a failed row remap fails `memory`
(DCGM's error 27-style text); a MIG-enabled GPU skips every test but `software` (DCGM does not run its
plugins on MIG-enabled GPUs); persistence mode off warns in `software`. Any failure exits 226 (what
DCGM 4.2.3 returned with a failed test); all passed, 0. Without the driver: the "Unable to connect"
message dcgmi prints without a host engine, exit 255. Other dcgmi commands: exit 2 with usage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from bcd_shared.system import CommandResult, LocalSystem

from bcd_simhost import gpus as simgpus
from bcd_simhost.nvidia_smi import loaded_driver, opt, select

VERSION = "4.2.3"
DEVICE_ID = "2335"  # H200's PCI device id
_CATEGORY = {
    "software": "Deployment",
    "pcie": "Integration",
    "memory": "Hardware",
    "diagnostic": "Hardware",
    "pulse_test": "Hardware",
    "memtest": "Hardware",
    "memory_bandwidth": "Stress",
    "targeted_stress": "Stress",
    "targeted_power": "Stress",
}
_LEVELS = {
    1: ("software",),
    2: ("software", "pcie", "memory"),
    3: ("software", "pcie", "memory", "memory_bandwidth", "diagnostic", "targeted_stress", "targeted_power"),
    4: (
        "software",
        "pcie",
        "memory",
        "memory_bandwidth",
        "diagnostic",
        "targeted_stress",
        "targeted_power",
        "pulse_test",
        "memtest",
    ),
}
NO_HOSTENGINE = (
    "Error: unable to establish a connection to the specified host: localhost\n"
    "Error: Unable to connect to host engine. Host engine connection invalid/disconnected.\n"
)


def _res(argv: Sequence[str], rc: int, out: str = "", err: str = "") -> CommandResult:
    return CommandResult(tuple(argv), rc, out.encode(), err.encode())


def _result(gpu: dict[str, Any], status: str, warning: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {
        "entity_group": "GPU",
        "entity_group_id": 1,
        "entity_id": gpu["index"],
        "status": status,
    }
    if warning:
        out["warnings"] = [{"error_category": 3, "error_id": 27, "error_severity": 2, "warning": warning}]
    return out


def _test(name: str, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    results = []
    for g in gpus:
        if name == "software":
            if not g["persistence_mode"]:
                text = (
                    f"Persistence Mode: Persistence mode for GPU {g['index']} is disabled. "
                    'Enable persistence mode by running "nvidia-smi -i <gpuId> -pm 1 " as root.'
                )
                results.append(_result(g, "Warn", text))
            else:
                results.append(_result(g, "Pass"))
        elif g["mig_enabled"]:
            results.append(_result(g, "Skip"))
        elif name in ("memory", "memtest") and (g["ecc_uncorrected_volatile"] or g["remap_failure"]):
            text = (
                f"GPU {g['index']} Memory test failed: {g['ecc_uncorrected_volatile']} uncorrectable "
                "volatile ECC errors (DBE) detected"
                + ("; a row remapping failure is recorded" if g["remap_failure"] else "")
            )
            results.append(_result(g, "Fail", text))
        else:
            results.append(_result(g, "Pass"))
    order = ("Fail", "Warn", "Pass", "Skip")
    summary = next((s for s in order if any(r["status"] == s for r in results)), "Skip")
    doc: dict[str, Any] = {"name": name, "results": results, "test_summary": {"status": summary}}
    if name != "software" and any(g["mig_enabled"] for g in gpus):
        doc["test_summary"]["info"] = ["MIG is enabled on a GPU of this run: its plugins were skipped"]
    return doc


def dcgmi(system: LocalSystem, argv: Sequence[str], stdin: bytes | None) -> CommandResult:
    args = list(argv[1:])
    if not args or args[0] != "diag" or "-j" not in args:
        return _res(argv, 2, err="Usage: dcgmi diag -r <level> -j [-i <gpu ids>] (simulated dcgmi)\n")
    level_text = opt(args, "-r") or opt(args, "--run")
    if level_text not in ("1", "2", "3", "4"):
        return _res(argv, 2, err=f"Error: invalid run level {level_text!r}: must be 1, 2, 3 or 4\n")
    state = simgpus.load_state(system)
    if state is None or loaded_driver(system, state) is None:
        return _res(argv, 255, err=NO_HOSTENGINE)
    chosen = select(state, opt(args, "-i"))
    if chosen is None:
        return _res(argv, 255, err="Error: Invalid GPU ID specified in -i\n")
    by_category: dict[str, list[dict[str, Any]]] = {}
    for name in _LEVELS[int(level_text)]:
        by_category.setdefault(_CATEGORY[name], []).append(_test(name, chosen))
    doc = {
        "DCGM Diagnostic": {
            "test_categories": [{"category": c, "tests": t} for c, t in by_category.items()],
        },
        "entity_groups": [
            {
                "entity_group": "GPU",
                "entity_group_id": 1,
                "entities": [
                    {"device_id": DEVICE_ID, "entity_id": g["index"], "serial_num": g["serial"]}
                    for g in chosen
                ],
            }
        ],
        "metadata": {"Driver Version Detected": state["driver_version"], "version": VERSION},
    }
    failed = any(
        r["status"] == "Fail"
        for cat in doc["DCGM Diagnostic"]["test_categories"]  # type: ignore[index]
        for t in cat["tests"]
        for r in t["results"]
    )
    return _res(argv, 226 if failed else 0, out=json.dumps(doc, indent=1) + "\n")
