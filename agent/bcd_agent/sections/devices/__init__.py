"""The devices section: NodeSpec.devices turned into CDI holds (see docs/devices.md).

model.py (domain types, from_wire), atoms.py (atoms against the inventory), slices.py (hold slices),
plan.py (the pure planner: the seeds' six steps), observe.py (reading holds back from the files),
apply.py (executors and the applier), events.py (AllocationBound/Released/Failed, signed reports),
kube.py (pod-resources and pod processes), busy.py (gpu.reset / diag.dcgm busy checks and the
gpu.reset core), section.py (the Section the converge runner calls).
"""
