"""Persistent volumes in the converge pass (DLV-VOL): what the instances section runs around its plan.

- `before`: with the domains' open volumes (running or paused domains, less those the pass stops or
  deletes: DLV-VOL-20/21), `plan_volumes`, then the creates and growths run at once, before any
  instance is defined (DLV-VOL-08/09). A refused volume keeps its size (DLV-VOL-29). The instances whose
  attachments fail lose their creates, starts and resumes and report why; a running one is not stopped
  for a spec-level refusal (DLV-VOL-23). Only a second holder of an open volume is stopped: a running
  domain holding a volume that a holder earlier in spec order has open lets go of it (DLV-VOL-24).
- `after`: the live resizes of grown volumes in every guest that has them open (DLV-VOL-11), then, with
  the runtimes listed again, the destroys of unlisted volumes no domain holds (DLV-VOL-25..27).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from attrs import evolve
from bcd_shared.errors import StepError

from bcd_agent.sections.instances.model import Desired, InstancesSpec
from bcd_agent.sections.instances.plan import (
    _ORDER,
    Create,
    Delete,
    Grow,
    Plan,
    Resume,
    RuntimeView,
    Start,
    Stop,
    Suspend,
)
from bcd_agent.sections.instances.runtimes.base import PAUSED, RUNNING
from bcd_agent.sections.instances.volumes import VolumePlan, VolumeRefused, VolumeStore, plan_volumes

log = logging.getLogger("bcd.instances.volumes")


def held(views: Mapping[str, RuntimeView], leaving: set[str]) -> dict[str, tuple[tuple[str, bool], ...]]:
    return {
        d.name: tuple((v, ro) for v, ro, _t in d.volumes)
        for view in views.values()
        for d in view.domains
        if d.managed and d.state in (RUNNING, PAUSED) and d.volumes and d.name not in leaving
    }


def before(
    store: VolumeStore, spec: InstancesSpec, views: Mapping[str, RuntimeView], the_plan: Plan
) -> tuple[Plan, VolumePlan]:
    leaving = {s.name for s in the_plan.steps if isinstance(s, Stop | Delete)}
    attachments = [
        (i.id, i.volumes, i.desired in (Desired.RUNNING, Desired.PAUSED))
        for i in spec.instances
        if i.desired is not Desired.DELETED and i.volumes
    ]
    if not store.exists():
        try:
            store.ensure()
        except OSError as exc:
            log.warning("instances: no volume store: %s", exc)
            return no_store(spec, the_plan), VolumePlan()
    stored = store.list()
    vplan = plan_volumes(
        spec.volumes, attachments, held(views, leaving), stored, store.space(stored.values())
    )
    refused = dict(vplan.refused)
    for step in vplan.before:
        try:
            if step.kind == "create":
                store.create(step.volume)
            elif step.kind == "grow":
                store.grow(step.volume, store.list()[step.volume.id])
            elif step.kind == "adopt":
                store.adopt(step.volume, store.list()[step.volume.id])
        except VolumeRefused as exc:
            refused[step.volume.id] = exc.message
        except OSError as exc:
            refused[step.volume.id] = f"volume {step.volume.id}: {exc}"
    errors = dict(vplan.errors)
    for inst_id, vols, _up in attachments:
        if inst_id not in errors:
            bad = next((refused[v] for v, _ro in vols if v in refused), None)
            if bad is not None:
                errors[inst_id] = bad
    errors = {k: v for k, v in errors.items() if k not in the_plan.errors or k in vplan.let_go}
    if not errors:
        return the_plan, evolve(vplan, refused=refused)
    steps = [
        s
        for s in the_plan.steps
        if not (isinstance(s, Create | Grow | Start | Resume) and _name(s) in errors)
        and not (isinstance(s, Stop | Suspend) and s.name in vplan.let_go)
    ]
    # A second holder of an open volume lets go of it: its domain is stopped (DLV-VOL-24).
    runtime_of = {d.name: d.runtime for view in views.values() for d in view.domains}
    steps += [Stop(runtime_of[i], i) for i in vplan.let_go if i in runtime_of]
    steps = sorted(steps, key=lambda s: _ORDER[type(s)])
    waiting = {k: v for k, v in the_plan.waiting.items() if k not in errors}
    gated = evolve(the_plan, steps=tuple(steps), errors={**the_plan.errors, **errors}, waiting=waiting)
    return gated, evolve(vplan, refused=refused, errors=errors)


def _name(s: Create | Grow | Start | Resume) -> str:
    return s.instance.id if isinstance(s, Create | Grow) else s.name


def after(
    store: VolumeStore,
    vplan: VolumePlan,
    runtimes: Mapping[str, object],
    views_before: Mapping[str, RuntimeView],
    views_after: Mapping[str, RuntimeView],
) -> dict[str, str]:
    """Live resizes, then destroys; instance id -> a failed resize (retried next pass: the guest's size
    is not observed, so the runtime's blockresize is idempotent)."""
    failures: dict[str, str] = {}
    targets = {
        (d.name, v): (d.runtime, t)
        for view in views_before.values()
        for d in view.domains
        for v, _ro, t in d.volumes
    }
    for inst, vid, size in vplan.resize:
        runtime_name, target = targets.get((inst, vid), ("", ""))
        rt = runtimes.get(runtime_name)
        resize = getattr(rt, "resize_volume", None)
        if resize is None or not target:
            continue
        try:
            resize(inst, target, size)
        except StepError as exc:
            failures[inst] = exc.message
    if any(v.error is not None for v in (*views_before.values(), *views_after.values())):
        # A runtime that could not be listed may hold any volume open: nothing is destroyed this pass.
        return failures
    still = held(views_after, set())
    in_use = {v for vols in still.values() for v, _ in vols}
    for step in vplan.after:
        if step.volume.id in in_use:
            continue  # a domain still has it open (a stop that failed): never destroyed (DLV-VOL-26)
        try:
            store.destroy(step.volume.id)
            log.info("instances: volume %s destroyed (no longer listed)", step.volume.id)
        except OSError as exc:
            log.warning("instances: destroying volume %s failed (retried next pass): %s", step.volume.id, exc)
    return failures


def no_store(spec: InstancesSpec, the_plan: Plan) -> Plan:
    """Without a volume store, an instance that attaches a volume fails (it is never started without)."""
    errors = {
        i.id: "volumes: this host keeps no volume store"
        for i in spec.instances
        if i.volumes and i.desired is not Desired.DELETED and i.id not in the_plan.errors
    }
    if not errors:
        return the_plan
    steps = tuple(
        s
        for s in the_plan.steps
        if not (isinstance(s, Create | Grow | Start | Resume) and _name(s) in errors)
    )
    return evolve(the_plan, steps=steps, errors={**the_plan.errors, **errors})
