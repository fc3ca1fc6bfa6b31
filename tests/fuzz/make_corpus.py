"""Write the seed corpus under tests/fuzz/corpus/ (run once; the files are committed).

`python tests/fuzz/make_corpus.py` from the repository root with the venv's python. Each seed is a small,
valid (or nearly valid) input of its target, built with the project's own encoders, so the fuzzer starts
from the shapes production sees. Real nvidia-smi captures are not copied here: run.py adds
../shared/reference/nvidia-smi as a further read-only corpus when it is present.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from fuzz.targets import CORPUS, dump  # noqa: E402


def _write(name: str, seeds: list[bytes]) -> None:
    folder = CORPUS / name
    folder.mkdir(parents=True, exist_ok=True)
    for data in seeds:
        (folder / hashlib.sha256(data).hexdigest()[:16]).write_bytes(data)


def main() -> None:
    from bcd_helper.ops.table import OPS
    from bcd_shared import wire

    ops = sorted(OPS)
    _write(
        "helper_frame",
        [
            dump({"op": "ping", "args": {}}),
            dump(
                {"op": "file.write", "args": {"kind": "cdi", "id": "a1", "content": '{"x": [1, 2.5, null]}'}}
            ),
            b'{"op": "x", "args": {"a": "\\u00e9\\ud83d\\ude00", "b": [[[]]], "c": true}}',
        ],
    )
    requests = []
    for i in range(len(ops)):
        requests.append(bytes([i]) + dump({}))
    requests.append(bytes([ops.index("ping")]) + dump({}) if "ping" in ops else b"\x00{}")
    if "file.write" in ops:
        requests.append(
            bytes([ops.index("file.write")])
            + dump({"kind": "allocation-env", "id": "a1", "content": "A=1\n"})
        )
    _write("helper_request", requests)

    spec = wire.NodeSpec(
        host=wire.HostSection(units=[wire.HostUnit(name="sysctl", settings='{"vm.swappiness":10}')]),
    )
    full = wire.DesiredStateBody(node_id="node-a", generation=3, spec_hash="h", full=spec)
    patch = wire.DesiredStateBody(
        node_id="node-a",
        generation=4,
        spec_hash="h2",
        base_generation=3,
        patch=wire.NodeSpecPatch(host=wire.HostSection()),
    )
    _write(
        "desired_state",
        [bytes(full), bytes(patch), bytes(wire.DesiredStateBody(node_id="node-a", generation=1))],
    )

    body = wire.CommandBody(
        id="01ARZ3NDEKTSV4RRFFQ69G5FAV",
        node_id="node-a",
        seq=1,
        kind="inventory.refresh",
        lane=wire.Lane.CONTROL,
        not_after=1_795_000_000_000,
    )
    _write(
        "command",
        [
            bytes(body),
            bytes(wire.CommandBody(id="01ARZ3NDEKTSV4RRFFQ69G5FAW", node_id="node-a", kind="gpu.reset")),
        ],
    )
    _write(
        "gateway_message",
        [
            bytes(wire.GatewayMessage(ack=wire.Ack(journal_id="j1", event_seq=3))),
            bytes(wire.GatewayMessage(command=wire.Command(body=bytes(body), signature=b"s" * 64))),
        ],
    )
    bundle = wire.TrustBundle(
        version=2, approvals_required=2, approver_keys=[wire.ApproverKey(key_id="a1", public_key=b"k" * 32)]
    )
    _write("trust_bundle", [bytes(bundle), bytes(wire.TrustBundle(version=1))])
    _write(
        "node_config",
        [
            b'data_dir = "/var/lib/bcd"\n[control_plane]\naddress = "cp.example.com:443"\n',
            b'data_dir = "/var/lib/bcd"\n[helper]\nsocket = "/run/bcd/helper.sock"\n[devices]\n',
        ],
    )
    _write(
        "helper_config",
        [
            b'[helper]\nnode_user = "bcd"\n',
            b'[helper]\nnode_user = "bcd"\ncommand_root_sha256 = "' + b"ab" * 32 + b'"\n',
        ],
    )
    _write(
        "nvidia_smi",
        [
            b"\x00GPU 0: NVIDIA H200 (UUID: GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b)\n"
            b"  MIG 3g.71gb     Device  0: (UUID: MIG-1a2b3c4d-0000-0000-0000-000000000000)\n",
            b"\x01"
            + b"0, GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b, NVIDIA H200, 00000000:19:00.0, 143771, Disabled,"
            b" Enabled, 0, No, No, 590.48.01\n",
            b'\x02<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>590.48.01</driver_version>'
            b'<attached_gpus>1</attached_gpus><gpu id="00000000:19:00.0"><uuid>GPU-1</uuid>'
            b"<minor_number>0</minor_number></gpu></nvidia_smi_log>\n",
            b"\x03GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b)\n"
            b"  MIG 3g.20gb     Device  0: (UUID: MIG-1a2b3c4d-0000-0000-0000-000000000000)\n"
            b"  MIG 1g.5gb      Device  1: (UUID: MIG-GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b/2/0)\n"
            b'\x00<?xml version="1.0" ?>\n<nvidia_smi_log><driver_version>510.47.03</driver_version>'
            b'<attached_gpus>1</attached_gpus><gpu id="00000000:19:00.0">'
            b"<uuid>GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b</uuid><minor_number>0</minor_number>"
            b"<mig_mode><current_mig>Enabled</current_mig></mig_mode><mig_devices>"
            b"<mig_device><index>0</index><gpu_instance_id>1</gpu_instance_id>"
            b"<compute_instance_id>0</compute_instance_id></mig_device>"
            b"<mig_device><index>1</index><gpu_instance_id>2</gpu_instance_id>"
            b"<compute_instance_id>0</compute_instance_id></mig_device>"
            b"</mig_devices></gpu></nvidia_smi_log>\n",
            b"\x04GPU-2f9b6c1e-6d2a-4c1b-9a57-0c1d2e3f4a5b, 4242\n"
            b"MIG-1a2b3c4d-0000-0000-0000-000000000000, 4243\n",
            b"\x05+---------------------------------------------------------+\n"
            b"| GPU instances:                                          |\n"
            b"| GPU   Name             Profile  Instance   Placement    |\n"
            b"|                          ID       ID       Start:Size   |\n"
            b"|=========================================================|\n"
            b"|   0  MIG 3g.20gb          9        1          4:4       |\n"
            b"+---------------------------------------------------------+\n"
            b"| GPU     GPU       Name             Profile   Instance   Placement  |\n"
            b"|   0      1       MIG 3g.20gb          2*        0          0:3      |\n",
        ],
    )
    hold = {
        "cdiVersion": "0.6.0",
        "kind": "bcd.example/gpu",
        "devices": [{"name": "GPU-1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}],
        "annotations": {"bcd.example/allocation-id": "a1"},
    }
    _write(
        "cdi",
        [
            b"\x00" + json.dumps(hold).encode(),
            b"\x01" + json.dumps(hold).encode(),
            b"\x02BCD_ALLOCATION_ID=a1\nCUDA_VISIBLE_DEVICES=0\n",
        ],
    )


if __name__ == "__main__":
    main()
