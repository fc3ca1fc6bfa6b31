"""The development control plane's CLI, and docs/devplane.md "By hand" run as written (a scratch directory
for /tmp/bcd-dev, a freshly seeded simulated host for `.demo/root`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

from testsupport import REPO, wait_until


def _block() -> str:
    doc = (REPO / "docs" / "devplane.md").read_text()
    section = doc[doc.index("### By hand") :]
    match = re.search(r"```\n(.*?)```", section, re.S)
    assert match, "docs/devplane.md: no command block under 'By hand'"
    return match.group(1)


def test_the_by_hand_commands_apply_the_example_spec_and_the_node_observes_it(tmp_path: Path) -> None:
    """`bcd devplane apply examples/gpu-node.json` (the control plane's CLI; before: refused with
    KeyError "Unknown field 'hugepages2_mi'", since betterproto's from_dict misreads the protobuf JSON
    name `hugepages2mi` that `bcd sim` and `bcd plan` accept), then the node converges it."""
    from bcd_simhost.seed import seed

    host = tmp_path / "host"
    seed(host)
    work = tmp_path / "dev"
    script = _block().replace("D=/tmp/bcd-dev;", f"D={work};").replace(".demo/root", str(host))
    assert f"D={work};" in script and str(host) in script
    lines = script.splitlines()
    # Up to the apply; the lines after it are run once the node has applied the spec.
    cut = next(i for i, line in enumerate(lines) if line.startswith("bcd devplane apply")) + 1
    # Files, not pipes: the background node and control plane keep them open after bash exits.
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with out_path.open("w") as out_f, err_path.open("w") as err_f:
        run = subprocess.Popen(
            ["/bin/bash", "-c", "\n".join(lines[:cut])],
            cwd=REPO,
            stdout=out_f,
            stderr=err_f,
            start_new_session=True,  # the background node and control plane: one group to stop
        )
    try:
        run.wait(timeout=120)
        out, err = out_path.read_text(), err_path.read_text()
        assert run.returncode == 0, err
        assert out.splitlines()[-1] == "1", (out, err)  # the generation apply printed

        def shown() -> dict[str, object] | None:
            res = subprocess.run(
                ["/bin/bash", "-c", "\n".join([lines[0], *lines[1:2], *lines[cut : cut + 1]])],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            record: dict[str, object] = json.loads(res.stdout) if res.returncode == 0 else {}
            return record if record.get("observed_generation") == 1 else None

        wait_until("the node to observe generation 1", shown, timeout=90)
        status = subprocess.run(
            ["/bin/bash", "-c", "\n".join([lines[0], lines[1], *lines[cut + 1 :]])],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "generation: applied 1, observed 1" in status.stdout, status.stdout + status.stderr
        if os.geteuid() == 0:  # as root the node (no helper) takes the holds on the simulated host
            assert "alloc_train_0001" in status.stdout
    finally:
        os.killpg(run.pid, signal.SIGTERM)
        run.wait(timeout=30)


def test_join_tokens_never_begin_with_a_dash(tmp_path: Path) -> None:
    """`bcd join --token TOKEN`, as the docs write it, takes a token beginning with '-' for an option: one
    URL-safe base64 token in 64 did. The development control plane's tokens are hex."""
    from bcd_agent.devplane import DevPlane

    plane = DevPlane(tmp_path / "dp", listen=None)
    for _ in range(200):
        assert re.fullmatch(r"[0-9a-f]{48}", plane.issue_token())
