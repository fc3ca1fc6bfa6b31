"""`host_sim_system`: an alias of `sim_system`, kept for callers written before the GPU state was merged.

The simulated host has one nvidia-smi (nvidia_smi.py, with the host subcommands of nvidia_host.py
in its EXTENSIONS table) over one GPU state (gpus.json), so the host units and the devices section
see the same GPUs through the plain `sim_system`.
"""

from __future__ import annotations

from . import sim_system

host_sim_system = sim_system

__all__ = ["host_sim_system"]
