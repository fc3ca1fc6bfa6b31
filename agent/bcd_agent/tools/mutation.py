"""`make mutation`: mutation testing of the modules whose tests must fail when the code is wrong.

Runs mutmut 3 one scope at a time (a scope: the modules to mutate and the test folders that cover them),
so each mutant runs only the tests its functions reach, and records per module the mutants, killed,
survived, timeouts and the kill rate as JSON (`--out`, default .mutation/results.json), from which
docs/mutation.md's table is written. Not in CI: a full run takes hours on this project's machines.

    python -m bcd_agent.tools.mutation [SCOPE ...] [--list]
    python -m bcd_agent.tools.mutation SCOPE --only MODULE [--tests TEST ...] [--max-children 1]

`--only` mutates one module of a scope (its row in results.json is replaced, the scope's others kept);
`--tests` narrows the scope's tests to those that test the module (docs/mutation.md says which were used).

mutmut 3 names a mutant by its module path below `src/`, so each scope runs in a staging tree
(.mutation/stage) where the three packages sit side by side under src/ beside a copy of tests/ and the
files the tests read; a setup.cfg there names the scope's modules and tests. The checkout is never
touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# scope -> (modules to mutate, test folders or files that cover them). The catalogue's weakest areas
# first: the helper and pki (target 90 %), then the rest (target 85 %).
SCOPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "helper": (
        (
            "helper/bcd_helper/intent.py",
            "helper/bcd_helper/protocol.py",
            "helper/bcd_helper/server.py",
            "helper/bcd_helper/audit.py",
            "helper/bcd_helper/ops/*",
        ),
        ("tests/helper/",),
    ),
    # The helper one module at a time, each against the tests that reach it in the test process (mutmut
    # sees no coverage in a child, so tests that only drive a real `bcd helper serve` add run time and no
    # kill): `helper` above takes hours on this machine, these take minutes each.
    "helper-intent": (("helper/bcd_helper/intent.py",), ("tests/helper/test_intent_unit.py",)),
    "helper-protocol": (("helper/bcd_helper/protocol.py",), ("tests/helper/test_protocol_unit.py",)),
    "helper-audit": (
        ("helper/bcd_helper/audit.py",),
        (
            "tests/helper/test_audit_unit.py",
            "tests/helper/test_audit_and_config.py",
            "tests/helper/test_audit_tail.py",
            "tests/helper/test_audit_head_report.py",
            "tests/helper/test_round5_mutants.py",
        ),
    ),
    "helper-slices": (
        ("helper/bcd_helper/ops/slices.py",),
        ("tests/helper/test_slices_unit.py", "tests/helper/test_round5_mutants.py"),
    ),
    "helper-hostops": (
        ("helper/bcd_helper/ops/host.py", "helper/bcd_helper/ops/hostunit.py"),
        ("tests/helper/test_host_ops_unit.py",),
    ),
    "helper-logops": (
        ("helper/bcd_helper/ops/logs.py", "helper/bcd_helper/ops/auditops.py"),
        ("tests/helper/test_log_ops_unit.py",),
    ),
    "helper-files": (
        ("helper/bcd_helper/ops/files.py",),
        (
            "tests/helper/test_files_unit.py",
            "tests/helper/test_files_signed_unit.py",
            "tests/helper/test_server_ahead.py",
            "tests/helper/test_round5_mutants.py",
        ),
    ),
    "helper-access": (("helper/bcd_helper/ops/access.py",), ("tests/helper/test_access_unit.py",)),
    "helper-nft": (("helper/bcd_helper/ops/nft.py",), ("tests/helper/test_nft_unit.py",)),
    "helper-base": (("helper/bcd_helper/ops/base.py",), ("tests/helper/test_base_unit.py",)),
    "helper-table": (("helper/bcd_helper/ops/table.py",), ("tests/helper/test_table_unit.py",)),
    "helper-daemon": (
        ("helper/bcd_helper/ops/daemon.py",),
        ("tests/helper/test_daemon_unit.py", "tests/helper/test_round5_mutants.py"),
    ),
    "helper-libvirt": (("helper/bcd_helper/ops/libvirt.py",), ("tests/helper/test_libvirt_ops_unit.py",)),
    "helper-ch": (("helper/bcd_helper/ops/ch.py",), ("tests/helper/test_ch_ops_unit.py",)),
    "helper-server": (
        ("helper/bcd_helper/server.py",),
        (
            "tests/helper/test_server_unit.py",
            "tests/helper/test_helper_op_timeout.py",
            "tests/helper/test_server_ahead.py",
            "tests/helper/test_round5_mutants.py",
        ),
    ),
    "pki": (("shared/bcd_shared/pki/*",), ("tests/pki/",)),
    "shared": (
        (
            "shared/bcd_shared/rootpath.py",
            "shared/bcd_shared/cdi.py",
            "shared/bcd_shared/strictjson.py",
            "shared/bcd_shared/units/*",
        ),
        ("tests/host/", "tests/devices/", "tests/helper/"),
    ),
    # The host units one module at a time (`--only`), against the in-process unit tests: the simulated
    # host's programs are child processes, but the unit code runs in the test process, which mutmut sees.
    # Not `tests/helper/` (a real helper child: no coverage) nor the real-tool and whole-node tests; the
    # compliance files repeat the simulated host's runs and only slow each surviving mutant down.
    "shared-units": (
        ("shared/bcd_shared/units/*", "shared/bcd_shared/strictjson.py"),
        (
            "tests/host/test_units_edges.py",
            "tests/host/test_unit_rules.py",
            "tests/host/test_units_strength.py",
            "tests/host/test_units_simhost.py",
        ),
    ),
    # The journal's modules, not `crashdriver.py` (a test driver the crash tests start as a child and
    # SIGKILL: not the product, and mutmut sees no coverage in a child), against the tests that run the
    # journal in the test process. Left out: test_journal_crash.py (children only), test_journal_model.py
    # (a ~20 s hypothesis run per mutant, every function) and test_journal_bench.py.
    "journal": (
        (
            "agent/bcd_agent/journal/__init__.py",
            "agent/bcd_agent/journal/_files.py",
            "agent/bcd_agent/journal/_resolve.py",
            "agent/bcd_agent/journal/_schema.py",
            "agent/bcd_agent/journal/_store.py",
            "agent/bcd_agent/journal/_types.py",
        ),
        (
            "tests/journal/test_journal_basic.py",
            "tests/journal/test_journal_rules.py",
            "tests/journal/test_journal_cancel_attest.py",
            "tests/journal/test_journal_open.py",
            "tests/journal/test_journal_limits.py",
            "tests/journal/test_journal_storage.py",
            "tests/dispatch/test_batched_writes.py",
            "tests/dispatch/test_command_rate.py",
        ),
    ),
    "dispatch": (
        ("agent/bcd_agent/dispatch/acceptance.py", "agent/bcd_agent/dispatch/quorum.py"),
        ("tests/dispatch/",),
    ),
    # The pure planner against its pure tests (microseconds each: plan, apply to the in-memory host of
    # tests/devices/planhost.py, plan again). Not the simulated-host tests of tests/devices/ (a second of
    # setup each, systemctl children) nor test_devices_property.py (about 70 s per mutant).
    "devices": (
        ("agent/bcd_agent/sections/devices/plan.py",),
        ("tests/devices/test_devices_plan.py", "tests/devices/test_devices_plan_passes.py"),
    ),
    "session": (("agent/bcd_agent/session/spec.py",), ("tests/session/",)),
    # The XID watcher's pure core (docs/devices.md "XID errors"), against its in-process tests.
    "xid": (("agent/bcd_agent/inventory/xid.py",), ("tests/devices/test_xid_parse.py",)),
}
TARGETS = {"helper": 0.90, "pki": 0.90}
DEFAULT_TARGET = 0.85
REPO = Path(__file__).resolve().parents[3]


PACKAGES = {"agent": "bcd_agent", "helper": "bcd_helper", "shared": "bcd_shared"}
COPIED = ("tests", "proto", "examples", "deploy", "docs", "Makefile", "pyproject.toml")


def _staged(module: str) -> str:
    """`agent/bcd_agent/journal/*` -> `src/bcd_agent/journal/*`."""
    folder, _, rest = module.partition("/")
    return "src/" + rest if folder in PACKAGES else module


def _setup_cfg(modules: tuple[str, ...], tests: tuple[str, ...]) -> str:
    lines = ["[mutmut]", "source_paths=src", "only_mutate="]
    lines += [f"    {_staged(m)}" for m in modules]
    lines += ["pytest_add_cli_args_test_selection="] + [f"    {t}" for t in tests]
    lines += ["also_copy="] + [f"    {c}" for c in COPIED]
    lines += ["pytest_add_cli_args=", "    -p", "    no:cacheprovider", "    -q"]
    return "\n".join(lines) + "\n"


def _stage(stage: Path) -> None:
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "src").mkdir(parents=True)
    for folder, package in PACKAGES.items():
        shutil.copytree(REPO / folder / package, stage / "src" / package)
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, stage / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, stage / name)


def _module_of(mutant: str) -> str:
    """`bcd_agent.journal.store.x_resolve__mutmut_3` -> `bcd_agent/journal/store.py`."""
    dotted = mutant.split(".x_")[0].split(".xǁ")[0]
    package, _, rest = dotted.partition(".")
    folder = {p: f for f, p in PACKAGES.items()}.get(package, package)
    return f"{folder}/{package}/{rest.replace('.', '/')}.py"


def run_scope(
    name: str,
    mutmut: str,
    only: tuple[str, ...] = (),
    tests_override: tuple[str, ...] = (),
    max_children: int | None = None,
) -> dict[str, dict[str, int]]:
    modules, tests = SCOPES[name]
    modules = only or modules
    tests = tests_override or tests
    stage = REPO / ".mutation" / "stage"
    _stage(stage)
    (stage / "setup.cfg").write_text(_setup_cfg(modules, tests))
    env = {**os.environ, "BCD_SHARED_MATERIAL": str(REPO.parent / "shared")}
    # mutmut's progress goes to a log beside the results: a run that stops early (a clean test failing
    # under load, say) leaves its mutants "not checked", and the log says why.
    with (REPO / ".mutation" / f"{name}.log").open("wb") as log:
        children = ["--max-children", str(max_children)] if max_children else []
        subprocess.run(
            [mutmut, "run", *children], cwd=stage, check=False, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    out = subprocess.run(
        [mutmut, "results", "--all", "true"], cwd=stage, capture_output=True, text=True, env=env, check=False
    )
    counts: dict[str, Counter[str]] = {}
    left: list[str] = []
    for line in out.stdout.splitlines():
        mutant, _, status = line.strip().rpartition(": ")
        if not mutant:
            continue
        counts.setdefault(_module_of(mutant), Counter())[status] += 1
        if status != "killed":
            left.append(f"{mutant}: {status}")
    # What was not killed, kept beside the log: the stage (where `mutmut show` works) is rebuilt by the
    # next scope's run.
    (REPO / ".mutation" / f"{name}.survivors").write_text("".join(f"{x}\n" for x in left))
    return {m: dict(c) for m, c in sorted(counts.items())}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scopes", nargs="*", help=f"scopes to run (default: all of {', '.join(SCOPES)})")
    parser.add_argument("--list", action="store_true", help="print the scopes and exit")
    parser.add_argument("--out", type=Path, default=REPO / ".mutation" / "results.json")
    parser.add_argument("--only", nargs="+", default=[], help="mutate only these modules of the scope")
    parser.add_argument("--tests", nargs="+", default=[], help="run these tests instead of the scope's")
    parser.add_argument("--max-children", type=int, help="mutmut's parallel test runs (default: cores)")
    args = parser.parse_args()
    if args.list:
        for name, (modules, tests) in SCOPES.items():
            print(f"{name}: {' '.join(modules)}  <-  {' '.join(tests)}")
        return 0
    mutmut = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    for name in args.scopes or list(SCOPES):
        if name not in SCOPES:
            parser.error(f"unknown scope {name!r} (--list shows them)")
        got = run_scope(name, mutmut, tuple(args.only), tuple(args.tests), args.max_children)
        results[name] = {**results.get(name, {}), **got} if args.only else got
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
        for module, c in results[name].items():
            total = sum(c.values())
            killed = c.get("killed", 0)
            print(
                f"{name:9} {module:55} {total:5} mutants  {killed:5} killed  "
                f"{c.get('survived', 0):4} survived"
            )
            if c.get("not checked", 0):
                print(
                    f"{name:9} {c['not checked']} mutants not checked: see .mutation/{name}.log",
                    file=sys.stderr,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
