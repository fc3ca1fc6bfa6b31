"""The grpclib stubs of the bcd.v1 services (generated: ``_gen/bcd_v1.py``; see bcd_agent.tools.genproto).

``SessionStub(channel).stream(...)`` is the node's side of the one bidirectional session stream
(NodeMessage up, GatewayMessage down); ``SessionBase`` is the gateway's. ``JoinStub`` / ``JoinBase`` are the
unary Join service. The messages are bcd_shared.wire's; only the agent (and the development control plane)
imports this package, since it loads grpclib.
"""

from bcd_agent.wire._gen.bcd_v1 import JoinBase, JoinStub, SessionBase, SessionStub

SESSION_STREAM_PATH = "/bcd.v1.Session/Stream"
JOIN_PATH = "/bcd.v1.Join/Join"

__all__ = ["JOIN_PATH", "SESSION_STREAM_PATH", "JoinBase", "JoinStub", "SessionBase", "SessionStub"]
