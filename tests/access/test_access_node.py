"""`bcd node` with the access section wired: a spec from the development control plane converges it on a
simulated host (the node acting directly, as root would), the status reports it, and an emptied section
removes the files. Uses tests/session/test_node_wiring.py's World."""

from __future__ import annotations

from pathlib import Path

from bcd_shared import access as acc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from session.test_node_wiring import World, running


async def test_DLV_ACC_01_06_bcd_node_converges_the_access_section(tmp_path: Path) -> None:
    key = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
        .decode()
    )
    world = World(tmp_path)
    async with running(world, world.config()) as node:
        assert node.access_section is not None
        principals = [f"alice@{world.node_id}", "bob@another-node"]
        spec = {
            "access": {
                "execTicketJwks": '{"keys":[]}',
                "sshCaKeys": [key],
                "principals": principals,
                "revokedSerials": ["7"],
            }
        }
        world.plane.apply_spec(world.node_id, spec)
        await world.observed(1)
        assert world.section("access")["state"] == "SECTION_STATE_CONVERGED"
        for path, data in acc.render([key], principals, [7], world.node_id).files.items():
            assert world.system.read_bytes(path) == data, path
        assert node.access_section.current_jwks() == '{"keys":[]}'
        world.plane.apply_spec(world.node_id, {"access": {}})
        await world.observed(2)
        assert world.section("access")["state"] == "SECTION_STATE_CONVERGED"
        assert world.system.read_bytes(acc.SSHD_DROPIN) is None
        assert world.system.read_bytes(acc.principals_path("alice")) is None
