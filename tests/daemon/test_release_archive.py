"""The release archive's `__main__.py` on a host installed from bcd's packages (docs/daemon.md "Where it
runs"): the third-party libraries live in bcd-node's venv, not system-wide, so a release that runs on the
host's python3 finds them there, before the host's own site directories, and its own modules stay first.

The archives are real zipapps built by `build_release` from small wheels made here; they run under the
interpreter without its site directories (`-I -S`), so only the archive, the standard library and what
`__main__.py` adds are on the path."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from bcd_agent.sections.daemon.release import PACKAGED_VENV, build_release, main_source

PROBE = "bcd_release_probe_lib"  # a "third-party" module only the fake venv holds


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path


def _agent_wheel(tmp: Path) -> Path:
    cli = (
        "import sys\n\n\ndef main():\n"
        f"    import {PROBE}\n"
        "    import bcd_agent\n"
        f"    print({PROBE}.WHERE, bcd_agent.WHERE, sys.path.index({PROBE}.__file__.rsplit('/', 1)[0]) "
        "== len(sys.path) - 1)\n"
        "    return 0\n"
    )
    return _wheel(
        tmp / "bcd_agent-9.9.9-py3-none-any.whl",
        {"bcd_agent/__init__.py": "WHERE = 'archive'\n", "bcd_agent/cli.py": cli},
    )


def _venv(tmp: Path) -> Path:
    """A stand-in for /opt/bcd/node: the probe and an older bcd_agent in its site-packages."""
    venv = tmp / "opt/bcd/node"
    site = venv / "lib/python{}.{}/site-packages".format(*sys.version_info[:2])
    (site / "bcd_agent").mkdir(parents=True)
    (site / f"{PROBE}.py").write_text("WHERE = 'venv'\n")
    (site / "bcd_agent/__init__.py").write_text("WHERE = 'venv (the packaged version)'\n")
    return venv


def _run(archive: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-I", "-S", str(archive)], capture_output=True, text=True, timeout=60
    )


def test_a_release_finds_the_packaged_venvs_libraries_last_and_runs_its_own_modules(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    archive = tmp_path / "bcd.pyz"
    build_release([_agent_wheel(tmp_path)], archive, packaged_venv=str(venv))
    done = _run(archive)
    assert done.returncode == 0, done.stderr
    # The probe came from the venv, bcd_agent from the archive (not the venv's older one), and the
    # venv's site-packages is the last entry of the path.
    assert done.stdout.split() == ["venv", "archive", "True"]


def test_the_venvs_libraries_come_before_the_hosts_site_directories(tmp_path: Path) -> None:
    """The host's dist-packages holds an older copy of a library the venv also holds (Debian's
    python3-cryptography 38 under a venv's 50: the release crashed at import, found by the booted
    self-update test): the venv's copy runs, and the standard library stays ahead of both."""
    venv = _venv(tmp_path)
    host = tmp_path / "usr/lib/python3/dist-packages"
    host.mkdir(parents=True)
    (host / f"{PROBE}.py").write_text("WHERE = 'host'\n")
    (host / "json.py").write_text("raise SystemExit('the host shadowed the standard library')\n")
    archive = tmp_path / "bcd.pyz"
    cli = (
        "import sys\n\n\ndef main():\n"
        f"    import {PROBE}, bcd_agent, json\n"
        f"    print({PROBE}.WHERE, bcd_agent.WHERE, sys.path.index({str(host)!r}) - sys.path.index("
        f"{PROBE}.__file__.rsplit('/', 1)[0]))\n"
        "    return 0\n"
    )
    wheel = _wheel(
        tmp_path / "bcd_agent-9.9.9-py3-none-any.whl",
        {"bcd_agent/__init__.py": "WHERE = 'archive'\n", "bcd_agent/cli.py": cli},
    )
    build_release([wheel], archive, packaged_venv=str(venv))
    # As python3 runs it with its site directories: the host's dist-packages at the end of the path.
    run = f"import runpy, sys; sys.path.append({str(host)!r}); "
    run += f"runpy.run_path({str(archive)!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-I", "-S", "-c", run], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["venv", "archive", "1"]


def test_without_the_packaged_venv_a_release_adds_nothing(tmp_path: Path) -> None:
    archive = tmp_path / "bcd.pyz"
    build_release([_agent_wheel(tmp_path)], archive, packaged_venv=str(tmp_path / "opt/bcd/node"))
    done = _run(archive)
    assert done.returncode == 1
    assert f"No module named '{PROBE}'" in done.stderr


def test_the_default_main_names_bcd_nodes_packaged_venv() -> None:
    assert PACKAGED_VENV == "/opt/bcd/node"
    assert '_libs = "/opt/bcd/node/lib/python%d.%d/site-packages" % sys.version_info[:2]' in main_source()


@pytest.mark.parametrize("bad", ["opt/bcd/node", '/opt/"x', "/opt/%s", "/opt/\nimport os", "/opt/x\\"])
def test_a_packaged_venv_that_could_not_be_written_as_is_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="absolute path without quotes, backslashes or %"):
        main_source(bad)
