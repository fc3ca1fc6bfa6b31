"""bcd_shared.wire is messages only: importing it (as the root helper does) never loads grpclib."""

from __future__ import annotations

import subprocess
import sys

import bcd_shared.wire as wire
from bcd_shared.wire._gen.bcd import v1 as generated


def test_importing_the_messages_loads_no_grpclib() -> None:
    code = (
        "import sys\n"
        "import bcd_shared.wire, bcd_shared.wire.strict, bcd_shared.wire.kinds\n"
        "banned = ('grpclib', 'grpc', 'h2', 'trio', 'bcd_agent')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in banned]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_the_wire_package_re_exports_every_generated_name() -> None:
    assert set(wire.__all__) == set(generated.__all__) | {"ProtoAny"}


def test_the_stub_module_uses_the_shared_message_classes() -> None:
    from bcd_agent.wire import SessionBase, SessionStub
    from bcd_agent.wire._gen import bcd_v1

    assert bcd_v1.NodeMessage is wire.NodeMessage
    assert bcd_v1.GatewayMessage is wire.GatewayMessage
    handler = SessionBase().__mapping__()["/bcd.v1.Session/Stream"]
    assert handler.request_type is wire.NodeMessage and handler.reply_type is wire.GatewayMessage
    assert callable(SessionStub.stream)
