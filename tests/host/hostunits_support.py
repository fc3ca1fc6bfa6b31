"""Helpers for the host-config tests: a seeded simulated host and a unit runner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bcd_shared.system import LocalSystem
from bcd_shared.units import (
    REGISTRY,
    ApplyContext,
    UnitContext,
    UnitResult,
    converge_unit,
    parse_allowed_clusters,
)
from bcd_simhost import sim_system
from bcd_simhost.seed import seed

PIN = "ab" * 32
SERVER = "https://10.0.0.1:6443"
ALLOWED = parse_allowed_clusters(f"{SERVER}#sha256:{PIN}")
TOKEN = "abcdef.0123456789abcdef"
# A k8s-join unit's settings (the allowed cluster, a token from the broker, labels and a taint).
K8S = {
    "server": SERVER,
    "caCertSha256": PIN,
    "tokenRef": "secret://pool/k8s-token",
    "kubernetesVersion": "1.34.1",
    "nodeLabels": {"team": "ml"},
    "taints": ["gpu=true:NoSchedule"],
}


class FakeTokens:
    """A TokenSource standing for the SecretRequest: records what was fetched."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.fetched: list[str] = []
        self.consumed_count = 0

    def fetch(self, token_ref: str) -> str:
        self.fetched.append(token_ref)
        return self.token

    def consumed(self) -> None:
        self.consumed_count += 1


def make_host(tmp: Path) -> tuple[Path, LocalSystem]:
    root = tmp / "host"
    seed(root)
    return root, sim_system(root)


def run(
    system: LocalSystem,
    name: str,
    settings: dict[str, Any] | None,
    *,
    ctx: UnitContext | None = None,
    tokens: FakeTokens | None = None,
) -> UnitResult:
    unit = REGISTRY[name]
    decoded = None if settings is None else unit.decode_settings(json.dumps(settings))
    ctx = ctx or UnitContext(allowed_clusters=ALLOWED)
    return converge_unit(unit, decoded, system, ctx, ApplyContext(tokens=tokens or FakeTokens()))


def plan(
    system: LocalSystem, name: str, settings: dict[str, Any] | None, ctx: UnitContext | None = None
) -> Any:
    unit = REGISTRY[name]
    decoded = None if settings is None else unit.decode_settings(json.dumps(settings))
    ctx = ctx or UnitContext(allowed_clusters=ALLOWED)
    return unit.plan(decoded, unit.observe(system, decoded, ctx))
