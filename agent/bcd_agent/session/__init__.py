"""The node's session with the control plane (docs/session.md).

- core.py: SessionCore, the protocol logic without the transport (Hello, Welcome, specs, commands, cancel,
  acks, replay, heartbeats, status) - synchronous, driven message by message
- spec.py: judging a DesiredState (ignored / refused / patch base mismatch / accepted), patches
- identity.py: identity.json (node id, key, chain, trust bundle, join pin, gateway CA, server time mark)
- events.py: JournalEventSink (sections -> journal) and journal rows -> wire Events
- status.py: NodeStatus -> StatusReport
- backoff.py: capped exponential backoff with jitter
- transport.py: grpclib under trio-asyncio (the only module importing asyncio/grpclib), StrictCodec, Endpoint
- service.py: Session, the reconnecting trio service (`await nursery.start(session.run)`)

Import the submodules directly; this package imports nothing at load time (start-up stays lean).
"""
