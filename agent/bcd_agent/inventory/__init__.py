"""The node's inventory: GPUs and MIG devices from nvidia-smi (gpus.py, nvsmi.py), host memory,
huge pages and NUMA nodes for admission (host.py), and the inventory.refresh / diag.nvml cores
(handlers.py)."""
