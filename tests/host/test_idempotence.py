"""Idempotence on the simulated host for generated settings: apply, then plan -> no steps (HST-LVL-02/03)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from bcd_shared.system import LocalSystem
from hostunits_support import make_host, plan, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_BASE: list[Path] = []


def fresh_host() -> tuple[Path, LocalSystem]:
    """A copy of one seeded host (seeding once keeps the property fast)."""
    from bcd_simhost import sim_system

    if not _BASE:
        _BASE.append(make_host(Path(tempfile.mkdtemp(prefix="bcd-host-base-")))[0])
    dst = Path(tempfile.mkdtemp(prefix="bcd-host-")) / "host"
    shutil.copytree(_BASE[0], dst, symlinks=True)
    return dst, sim_system(dst)


SYSCTL_KEYS = [
    "vm.swappiness",
    "vm.max_map_count",
    "net.core.somaxconn",
    "kernel.pid_max",
    "net.ipv4.tcp_rmem",
]
unit_settings = st.one_of(
    st.tuples(
        st.just("sysctl"),
        st.dictionaries(st.sampled_from(SYSCTL_KEYS[:4]), st.integers(1, 100000), max_size=4),
    ),
    st.tuples(
        st.just("kernel-modules"),
        st.fixed_dictionaries(
            {
                "load": st.lists(
                    st.sampled_from(["tun", "vhost_net", "vfio-pci", "kvm_intel", "overlay"]),
                    max_size=4,
                    unique=True,
                )
            },
            optional={
                "options": st.dictionaries(
                    st.sampled_from(["tun", "vfio-pci"]),
                    st.sampled_from(["a=1", "ids=10de:2330 b=Y"]),
                    max_size=2,
                )
            },
        ),
    ),
    st.tuples(
        st.just("hugepages"),
        st.fixed_dictionaries(
            {},
            optional={
                "pages2m": st.integers(0, 4096),
                "pages1g": st.integers(0, 32),
                "transparent": st.sampled_from(["always", "madvise", "never"]),
                "perNuma": st.booleans(),
            },
        ),
    ),
    st.tuples(
        st.just("cpu"),
        st.fixed_dictionaries(
            {},
            optional={
                "governor": st.sampled_from(["performance", "schedutil", "ondemand", "powersave"]),
                "isolate": st.lists(st.integers(1, 63), max_size=6).map(
                    lambda xs: ",".join(map(str, sorted(set(xs))))
                ),
            },
        ),
    ),
    st.tuples(
        st.just("gpu-sharing"),
        st.fixed_dictionaries(
            {"mode": st.sampled_from(["mps", "timeslice"]), "replicas": st.integers(1, 48)}
        ),
    ),
    st.tuples(
        st.just("gpu-settings"),
        st.fixed_dictionaries({}, optional={"powerLimitWatts": st.integers(200, 700), "ecc": st.just(True)}),
    ),
    st.tuples(
        st.just("mig-layout"),
        st.fixed_dictionaries(
            {
                "layout": st.sampled_from(
                    [
                        "all-disabled",
                        "all-1g.18gb",
                        "all-3g.71gb",
                        "mixed:3g.71gb+2x2g.35gb",
                        "mixed:4g.71gb+3x1g.18gb",
                        "all-7g.141gb",
                    ]
                )
            }
        ),
    ),
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(unit_settings, min_size=1, max_size=2))
def test_HST_LVL_03_apply_then_plan_has_no_steps(units: list[tuple[str, dict[str, object]]]) -> None:
    root, system = fresh_host()
    try:
        for name, s in units:
            run(system, name, s)
            after = plan(system, name, s)
            # A unit may still wait for a reboot (cpu isolation), but it plans no further steps.
            assert after.steps == (), (name, json.dumps(s), [x.describe() for x in after.steps])
            assert all(i.kind == "reboot" for i in after.issues), after.issues
    finally:
        shutil.rmtree(root.parent, ignore_errors=True)
