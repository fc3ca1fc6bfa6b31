"""The instances section: NodeSpec.instances as VMs (see docs/instances.md).

model.py (domain types, from_wire, the spec's checks), placement.py (placement and host admission,
pure), plan.py (the pure planner: the seeds' rules first), section.py (observe, apply, the Section
the converge runner calls, the status report), runtimes/ (the runtime interface, libvirt-kvm and its
domain XML).
"""
