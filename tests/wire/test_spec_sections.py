"""The NodeSpec sections carry what the seed says each holds; each survives the wire byte for byte."""

from __future__ import annotations

from bcd_shared import wire


def _roundtrip(spec: wire.NodeSpec) -> wire.NodeSpec:
    data = bytes(spec)
    back = wire.NodeSpec.parse(data)
    assert bytes(back) == data
    return back


def test_DLV_SPEC_03_host_holds_units_with_canonical_json_settings() -> None:
    settings = '{"modules":["vfio_pci"]}'
    spec = _roundtrip(
        wire.NodeSpec(host=wire.HostSection(units=[wire.HostUnit(name="kmod", settings=settings)]))
    )
    assert spec.host is not None and [(u.name, u.settings) for u in spec.host.units] == [("kmod", settings)]


def test_DLV_SPEC_04_devices_hold_assignments() -> None:
    assignment = wire.DeviceAssignment(
        allocation_id="a1",
        reservation_id="r1",
        binding=wire.Binding.HOLD,
        devices=[wire.DeviceAtom(id="GPU-1", device_class="gpu")],
        env=["K=V"],
    )
    spec = _roundtrip(wire.NodeSpec(devices=wire.DevicesSection(assignments=[assignment])))
    assert spec.devices is not None
    got = spec.devices.assignments[0]
    assert (got.allocation_id, got.reservation_id, got.binding, got.devices, got.env) == (
        "a1", "r1", wire.Binding.HOLD, [wire.DeviceAtom(id="GPU-1", device_class="gpu")], ["K=V"],
    )  # fmt: skip


def test_DLV_SPEC_05_instances_hold_runtime_size_image_nics_gpus() -> None:
    names = {f for f in wire.InstanceSpec.__dataclass_fields__}
    assert {"runtime", "size", "image", "nics", "gpu_uuids"} <= names
    assert "volumes" in wire.InstancesSection.__dataclass_fields__
    spec = _roundtrip(
        wire.NodeSpec(
            instances=wire.InstancesSection(instances=[wire.InstanceSpec(id="i1", gpu_uuids=["GPU-1"])])
        )
    )
    assert spec.instances is not None and spec.instances.instances[0].gpu_uuids == ["GPU-1"]


def test_DLV_SPEC_06_access_holds_jwks_ca_keys_principals_revoked_serials() -> None:
    spec = _roundtrip(
        wire.NodeSpec(
            access=wire.AccessSection(
                exec_ticket_jwks='{"keys":[]}', ssh_ca_keys=["ssh-ed25519 AAAA ca"], principals=["ops"],
                revoked_serials=[7],
            )
        )
    )  # fmt: skip
    assert spec.access is not None
    assert (spec.access.exec_ticket_jwks, spec.access.ssh_ca_keys, spec.access.principals) == (
        '{"keys":[]}', ["ssh-ed25519 AAAA ca"], ["ops"],
    )  # fmt: skip
    assert list(spec.access.revoked_serials) == [7]


def test_DLV_SPEC_07_telemetry_holds_endpoint_interval_attributes_secret_ref() -> None:
    spec = _roundtrip(
        wire.NodeSpec(
            telemetry=wire.TelemetrySection(
                otlp_endpoint="https://otlp", export_interval_ms=15_000, resource_attributes={"site": "a"},
                headers_secret_ref="secret://otlp",
            )
        )
    )  # fmt: skip
    t = spec.telemetry
    assert t is not None
    assert (t.otlp_endpoint, t.export_interval_ms, dict(t.resource_attributes), t.headers_secret_ref) == (
        "https://otlp", 15_000, {"site": "a"}, "secret://otlp",
    )  # fmt: skip


def test_DLV_SPEC_08_daemon_holds_version_url_sha256_signature() -> None:
    d = wire.DaemonSection(version="1.2.3", url="https://r/bcd", sha256="ab" * 32, signature=b"\x01" * 64)
    spec = _roundtrip(wire.NodeSpec(daemon=d))
    assert spec.daemon == d


def test_DLV_SPEC_09_site_holds_boot_leases_and_cache_images() -> None:
    image = wire.CacheImage(url="https://img/a.raw", sha256="cd" * 32, format="raw")
    spec = _roundtrip(wire.NodeSpec(site=wire.SiteSection(cache_images=[image])))
    assert spec.site is not None and spec.site.cache_images == [image]
    assert "boot_leases" in wire.SiteSection.__dataclass_fields__
