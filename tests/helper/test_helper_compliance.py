"""Helper-side host-config items that had no test naming them (docs/compliance.md).

Covers HST-HLP-08 (the node waits 30 minutes plus a minute on the connection) and HST-HLP-11 (a helper
without host units answers `not configured`).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import pytest
from bcd_agent.helperclient import CONNECTION_SLACK_S, OP_TIMEOUT_S, HelperClient
from bcd_helper.ops import hostunit
from bcd_helper.ops.base import Refused
from bcd_helper.ops.table import OPS


def test_host_unit_table_entry_is_30_minutes() -> None:
    """The table's value only, naming no id: that the server applies it to the call is
    test_helper_op_timeout.py's test."""
    assert OPS["host.unit"].timeout_s == 30 * 60


def test_HST_HLP_08_node_waits_30_minutes_plus_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's socket timeout for host.unit is the helper's bound plus a minute on the connection."""
    assert OP_TIMEOUT_S["host.unit"] == OPS["host.unit"].timeout_s
    assert CONNECTION_SLACK_S == 60
    ours, theirs = socket.socketpair()
    timeouts: list[float | None] = []

    class Watched:
        def settimeout(self, value: float | None) -> None:
            timeouts.append(value)
            ours.settimeout(value)

        def __getattr__(self, name: str) -> Any:
            return getattr(ours, name)

    client = HelperClient("/nonexistent/helper.sock")
    monkeypatch.setattr(client, "_connect", lambda: Watched())
    theirs.close()  # the helper hangs up: only the wait the client set matters here
    with pytest.raises(Exception):  # noqa: B017 (the hang-up's error is not what is tested)
        client.call("host.unit", {"unit": "sysctl", "settings": "{}"})
    ours.close()
    assert timeouts == [31 * 60]


def test_HST_HLP_11_helper_without_host_units_answers_not_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """With bcd_shared.units not importable (a helper built without host units) the registry is absent and
    host.unit refuses with `not configured` before touching anything."""
    monkeypatch.setitem(sys.modules, "bcd_shared.units", None)  # import raises ImportError
    assert hostunit.unit_registry() is None

    class Verifier:
        def check_host_unit(self, unit: str, settings: str | None, intent: object) -> None:
            return None

    class Ctx:
        def intent_verifier(self) -> Verifier:
            return Verifier()

    class FakeCall:
        ctx = Ctx()

    monkeypatch.setattr(hostunit, "check_request", lambda call, req: None)
    req = hostunit.HostUnit.__new__(hostunit.HostUnit)
    object.__setattr__(req, "unit", "sysctl")
    object.__setattr__(req, "settings", "{}")
    object.__setattr__(req, "intent", None)
    with pytest.raises(Refused) as exc:
        hostunit.host_unit(FakeCall(), req)  # type: ignore[arg-type]
    assert "host.unit: not configured (this helper has no host units)" in str(exc.value)
