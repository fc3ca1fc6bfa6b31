"""bcd-helper: the root half of bcd, a narrow Unix-socket RPC that trusts nothing the agent says.

Imports bcd_shared and the standard library only (never the agent, grpclib or trio).
  server.py  socket, SO_PEERCRED, framing, dispatch through the one OPS table
  ops/       table.py (the OPS table) and one module per operation family
  intent.py  signed intent: roots, join record, trust bundle rotation, helper-intent.json
  audit.py   the hash-chained audit log
  config.py  root's config.toml
  cli.py     `bcd helper` / `bcd-helper`
"""
