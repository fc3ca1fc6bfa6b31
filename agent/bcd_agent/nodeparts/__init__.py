"""The parts `bcd node` composes around the sections and the dispatcher (bcd_agent.node builds them).

- `inventory.py`: `InventoryState`, the observation's GPU inventory reader and the heartbeat's
  inventory hash;
- `host.py`: `NodeHostSection` (the runner's `host` Section over wire specs), the unit context (busy
  devices, identity labels, allowed clusters), `TokenStagingSend` (host.unit through the helper, the
  k8s token staged first);
- `kinds.py`: the handlers of `gpu.reset`, `diag.nvml` and `node.reboot`.

Each module is imported by `Node.run` only when its part is built (the start-to-Hello budget).
"""
