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


def test_simulated_host_is_its_own_distribution() -> None:
    """The simulated host (fake nvidia-smi, systemctl, modprobe, ...) is bcd-simhost (devhost/), which
    neither Debian package installs: no module of shared/, helper/ or agent/ imports it statically, and
    the distributions the packages carry hold none of it (issue 15)."""
    assert not (REPO / "shared" / "bcd_shared" / "simhost").exists()
    assert (REPO / "devhost" / "bcd_simhost" / "__init__.py").is_file()
    for pkg in (REPO / "shared" / "bcd_shared", REPO / "helper" / "bcd_helper"):
        bad = [(str(p.relative_to(REPO)), m) for p, m in _imports(pkg) if m.split(".")[0] == "bcd_simhost"]
        assert bad == []
    text = (REPO / "devhost" / "pyproject.toml").read_text()
    assert 'name = "bcd-simhost"' in text and 'include = ["bcd_simhost*"]' in text


def _without_simhost(*argv: str) -> subprocess.CompletedProcess[str]:
    # None in sys.modules makes `import bcd_simhost` raise ModuleNotFoundError, as where it is not installed.
    code = (
        "import sys\n"
        "sys.modules['bcd_simhost'] = None\n"
        "from bcd_agent.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_simulated_root_needs_bcd_simhost(tmp_path: Path) -> None:
    """`--root DIR` (DIR not /) where bcd-simhost is absent: one line naming the distribution, exit 64
    (EX_USAGE), for the helper, the node, plan, status and sim alike; nothing is created under DIR."""
    root = tmp_path / "host"
    root.mkdir()  # a --root that is not there is refused before (bcd_shared.subcommands.root_dir)
    spec = str(REPO / "examples" / "gpu-node.json")
    cases = [
        ("helper", "serve", "--root", str(root)),
        ("node", "--root", str(root), "--config", str(tmp_path / "node.toml")),
        ("plan", "--spec", spec, "--root", str(root)),
        ("status", "--root", str(root), "--data-dir", str(tmp_path / "data")),
        ("sim", "--spec", spec, "--root", str(root), "--once"),
    ]
    for argv in cases:
        res = _without_simhost(*argv)
        assert res.returncode == 64, (argv, res.stderr)  # EX_USAGE
        assert "Traceback" not in res.stderr, argv
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "bcd-simhost" in lines[0] and f"--root {root}" in lines[0], (argv, lines)
        assert list(root.iterdir()) == [], argv
