"""bcd-shared: code common to the agent (unprivileged) and the helper (root).

Layout:
  wire/      generated protobuf messages (betterproto2) behind a thin re-exporting module;
             messages only, never grpclib stubs, so the helper stays free of grpclib
  pki/       signing purposes, envelopes over exact bytes, Ed25519, X.509 chains, trust bundles
  units/     the twelve host config units: settings types, validation, plan, apply
  system.py  the host `System` interface, the real host, and the simulated host's base
  errors.py  errors by origin: terminal (the spec asks for the impossible) vs retryable (the host)
  rootpath.py the root-only path rule and safe opens (used by the helper and by a root agent)
  rootsystem.py the System wrapper that writes under that rule (the helper's and a root agent's)
  subcommands.py the subcommand-table dispatcher of `bcd` and `bcd helper`

Nothing here imports the agent or the helper.
"""
