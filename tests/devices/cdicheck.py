"""A reusable check that a CDI spec is one a CDI loader accepts.

Every CDI spec bcd writes must validate against the official JSON schema (draft-07, from
../shared/reference/cdi-schema, read in place, never copied) AND the naming and version rules that
live in the CDI parser rather than the schema (bcd_shared.cdi.naming_errors; see
../shared/notes/real-host-testing.md). Import it from any test:

    from devices.cdicheck import assert_cdi_valid, assert_host_cdi_valid
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
import referencing.jsonschema
from bcd_shared import cdi
from testsupport import IN_CI, REFERENCE

SCHEMA_DIR = REFERENCE / "cdi-schema"


@functools.cache
def _validator() -> jsonschema.Draft7Validator | None:
    schema_path = SCHEMA_DIR / "schema.json"
    if not schema_path.exists():
        if IN_CI:
            pytest.fail(f"{schema_path} is missing under CI")
        return None
    schema = json.loads(schema_path.read_text())
    defs = json.loads((SCHEMA_DIR / "defs.json").read_text())
    registry = referencing.Registry().with_resource(
        "defs.json", referencing.jsonschema.DRAFT7.create_resource(defs)
    )
    return jsonschema.Draft7Validator(schema, registry=registry)


def loader_errors(doc: Any) -> list[str]:
    """Rules of the reference CDI library's loader beyond the schema: a device with empty containerEdits
    is refused ("invalid device, empty device edits", container-device-interface pkg/cdi/device.go),
    and the whole spec with it."""
    return [
        f"devices[{i}] {d.get('name')!r}: invalid device, empty device edits"
        for i, d in enumerate(doc.get("devices") or ())
        if isinstance(d, dict)
        and not any(v not in (None, [], {}) for v in (d.get("containerEdits") or {}).values())
    ]


def schema_errors(doc: Any) -> list[str]:
    validator = _validator()
    if validator is None:
        return []
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)
    ]


def assert_cdi_valid(spec: bytes | str | dict[str, Any]) -> dict[str, Any]:
    """Fail unless `spec` passes the official schema and CDI's naming/version rules; return the doc."""
    doc = json.loads(spec) if isinstance(spec, bytes | str) else spec
    problems = schema_errors(doc) + cdi.naming_errors(doc) + loader_errors(doc)
    assert problems == [], f"CDI spec refused: {problems}"
    return doc


def assert_host_cdi_valid(root: Path) -> int:
    """Check every bcd CDI spec under a (simulated) host root's /etc/cdi; return how many."""
    count = 0
    for path in sorted((root / "etc" / "cdi").glob("bcd-*.json")):
        assert_cdi_valid(path.read_bytes())
        count += 1
    return count
