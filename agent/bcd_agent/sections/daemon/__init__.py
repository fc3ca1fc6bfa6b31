"""The `daemon` section and `daemon.upgrade`: self-update of `bcd node` under `bcd helper`.

- model.py: `ReleaseTarget` from the wire, the pure `plan`;
- fetch.py: the download into the node's staging directory (SHA-256, bounded size, atomic rename);
- upgrade.py: `Upgrader`, the node's half shared by the section and the kind (confirm, download, swap);
- section.py: `DaemonSection`, the converger;
- release.py: what a release artifact is (a zipapp built from the wheels), `bcd release`.

The helper's half (verify, forward-only, freshness, the release directories, confirm and roll back) is
helper/bcd_helper/ops/daemon.py; docs/daemon.md has the whole flow.
"""

from __future__ import annotations


def running_version() -> str:
    """The version of the bcd-agent distribution this process runs (its release's metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("bcd-agent")
    except PackageNotFoundError:  # run from a source tree without an install
        return "0.0.0"
