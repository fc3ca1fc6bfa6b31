"""Schema rules of bcd.v1 that the seeds and the generated code depend on."""

from __future__ import annotations

import bcd_shared.wire as wire
import betterproto2
from wirehelpers import ENUM_CLASSES, MESSAGE_CLASSES, meta_of


def _fields(cls: type[betterproto2.Message]) -> dict[str, int]:
    meta = meta_of(cls)
    return {name: meta.meta_by_field_name[name].number for name in meta.sorted_field_names}


def test_DLV_SPEC_01_nodespec_sections_and_their_numbers() -> None:
    """Covers DLV-SPEC-01: seven sections numbered in converge order; the patch mirrors them."""
    expected = {"host": 1, "devices": 2, "instances": 3, "access": 4, "telemetry": 5, "daemon": 6, "site": 7}
    assert _fields(wire.NodeSpec) == expected
    assert _fields(wire.NodeSpecPatch) == expected
    assert {m.name.lower(): m.value for m in wire.Section if m.value} == expected


def test_DLV_CMD_01_command_body_has_every_seed_field() -> None:
    """Covers DLV-CMD-01: the envelope and every field of the seed's CommandBody table."""
    assert set(_fields(wire.CommandBody)) == {
        "id",
        "node_id",
        "seq",
        "kind",
        "payload",
        "lane",
        "not_after",
        "min_generation",
        "retry_safe",
        "idempotency_key",
        "self_terminating",
        "attested",
        "workflow_id",
        "step_id",
        "traceparent",
        "batch_id",
        "target_node_id",
    }
    assert set(_fields(wire.Command)) == {
        "body",
        "signature",
        "signer_chain",
        "attempt",
        "batch_approval",
        "batch_proof",
    }
    assert (
        wire.CommandBody().not_after == 0
    )  # int64 ms since the epoch; 0 = absent, which dispatch treats as expired


def test_signed_payloads_travel_as_bytes() -> None:
    """Signed bytes are never re-encoded: every signed thing is a bytes field of an envelope."""
    envelopes = {
        wire.DesiredState: "body",
        wire.Command: "body",
        wire.AttestedReport: "body",
        wire.SignedTrustBundle: "bundle",
        wire.JoinResponse: "body",
        wire.BatchApproval: "scope",
        wire.BatchProof: "leaf",
        wire.CommandUpdate: "attestation",
    }
    for cls, name in envelopes.items():
        assert meta_of(cls).meta_by_field_name[name].proto_type == betterproto2.TYPE_BYTES, cls.__name__


def test_no_field_shadows_a_message_method() -> None:
    reserved = {n for n in dir(betterproto2.Message) if not n.startswith("__")}
    clashes = [
        f"{cls.__name__}.{name}" for cls in MESSAGE_CLASSES for name in _fields(cls) if name in reserved
    ]
    assert clashes == []


def test_every_enum_starts_unspecified() -> None:
    for enum_cls in ENUM_CLASSES:
        zero = enum_cls(0)
        assert zero.name == "UNSPECIFIED", enum_cls.__name__


def test_seed_enum_values_exist() -> None:
    assert {s.name for s in wire.CommandState} >= {
        "ACKED",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
        "REJECTED",
        "CANCELLED",
    }
    assert {s.name for s in wire.SpecRequestReason} >= {"PATCH_BASE_MISMATCH", "MIN_GENERATION", "NO_SPEC"}
    assert {s.name for s in wire.SectionState} >= {"CONVERGED", "PROGRESSING", "FAILED", "UNSUPPORTED"}
    assert {s.name for s in wire.EventClass} >= {"METRIC", "TRANSITION", "RESULT"}
    assert {s.name for s in wire.Lane} >= {"CONTROL", "PROVISION", "BULK"}
    # The proto names are what messages such as "binding BINDING_INSTANCE is not supported" print.
    assert (
        wire.Binding.betterproto_value_to_renamed_proto_names()[int(wire.Binding.INSTANCE)]
        == "BINDING_INSTANCE"
    )
