"""bcd-agent: the unprivileged node daemon (`bcd node`), its CLI, the development control plane
and the simulator.

Layout (each a package or module of its own):
  cli.py       the `bcd` command: one table of subcommands, each imported only when used
  journal/     the SQLite journal: meta, commands, events, spec, exec tickets; Resolve/Recover/Sweep
  dispatch/    acceptance checks, lanes/credits/workers, resource locks, kind registry, quorum
  session/     the grpclib session under trio-asyncio (the only place asyncio is seen)
  converge/    the runner: section order, states, observed_generation, triggers
  sections/    one package per NodeSpec section: plan.py (pure) and apply.py
  inventory/   nvidia-smi parsing, meminfo, NUMA, hugepages
  helperclient.py  the client of the root helper's Unix-socket RPC
  devplane/    the development control plane (gateway, JoinService, secret broker)
  sim.py       `bcd sim`: devplane + helper + agent over a simulated host
  bench/       `bcd bench NAME --json`
"""
