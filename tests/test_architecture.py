"""House rules of the architecture, checked on the source (see docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from testsupport import REPO


def _imports(package_dir: Path) -> set[tuple[Path, str]]:
    found: set[tuple[Path, str]] = set()
    for path in package_dir.rglob("*.py"):
        if "_gen" in path.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update((path, alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add((path, node.module))
    return found


def test_helper_never_imports_agent_or_grpc() -> None:
    banned = ("bcd_agent", "grpclib", "trio", "trio_asyncio")
    bad = [
        (str(p.relative_to(REPO)), m)
        for p, m in _imports(REPO / "helper" / "bcd_helper")
        if m.split(".")[0] in banned
    ]
    assert bad == []


def test_shared_never_imports_agent_helper_or_grpc() -> None:
    banned = ("bcd_agent", "bcd_helper", "grpclib", "trio", "trio_asyncio")
    bad = [
        (str(p.relative_to(REPO)), m)
        for p, m in _imports(REPO / "shared" / "bcd_shared")
        if m.split(".")[0] in banned
    ]
    assert bad == []


def test_helper_process_loads_no_grpclib() -> None:
    """The helper's CLI, imported in a fresh interpreter, loads neither grpclib nor trio-asyncio."""
    code = (
        "import sys, bcd_helper.cli\n"
        "banned = ('grpclib', 'trio_asyncio', 'trio', 'bcd_agent')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in banned]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_tests_import_constants_from_testsupport() -> None:
    """Importing constants from the conftest module breaks once a subfolder has one: use testsupport."""
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("*.py")
        if ("from " + "conftest import") in p.read_text()
    ]
    assert offenders == []
