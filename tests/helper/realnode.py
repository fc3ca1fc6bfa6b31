"""A real unprivileged node against a real `bcd helper serve`: issue 9's signed-intent tests share this.

`RealNode` creates a `useradd --system` account, a simulated host under /var/tmp that the account can
traverse, and a helper whose config names the account's uid and gid as the node's. `call(doc)` sends one
request as that account: /usr/bin/python3 (stdlib only) run through `setpriv --reuid/--regid`, the request
on stdin, the answer printed back. The helper sees the account's uid through SO_PEERCRED, exactly as it
would see a compromised `bcd node`. Everything is removed afterwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from helperproc import HelperProcess, base_config, make_root, tree
from realkit import NodeUser

_CLIENT = (
    "import json,socket,struct,sys\n"
    "doc=sys.stdin.buffer.read()\n"
    "s=socket.socket(socket.AF_UNIX); s.settimeout(60); s.connect(sys.argv[1])\n"
    "s.sendall(struct.pack('>I',len(doc))+doc)\n"
    "def rd(n):\n"
    "    b=b''\n"
    "    while len(b)<n:\n"
    "        c=s.recv(n-len(b))\n"
    "        if not c: raise SystemExit('closed')\n"
    "        b+=c\n"
    "    return b\n"
    "n=struct.unpack('>I',rd(4))[0]; sys.stdout.write(rd(n).decode())\n"
)


class RealNode:
    """A real account as the node, a simulated host and a helper serving that account."""

    def __init__(self, config_extra: str = "", setup: Any = None) -> None:
        self.user = NodeUser()
        self.name, self.uid, self.gid = self.user.name, self.user.uid, self.user.gid
        self.parent = Path(tempfile.mkdtemp(prefix="bcd-node-", dir="/var/tmp"))
        self.helper: HelperProcess | None = None
        try:
            self.root = make_root(self.parent)
            if setup is not None:
                setup(self.root)
            self.start(config_extra)
        except BaseException:
            self.close()
            raise

    def start(self, config_extra: str) -> None:
        """(Re)start the helper; `config_extra` is top-level keys, then optionally `[helper]` and keys of
        that table (merged into the base [helper] table)."""
        if self.helper is not None:
            self.helper.stop()
        top, _, helper_keys = config_extra.partition("[helper]\n")
        self.helper = HelperProcess(self.root, top + base_config(self.uid, self.gid, extra=helper_keys))

    @property
    def h(self) -> HelperProcess:
        assert self.helper is not None
        return self.helper

    def call(self, doc: dict[str, Any]) -> dict[str, Any]:
        """One request as the node's real account; the answer."""
        done = subprocess.run(
            self.user.python(_CLIENT, self.h.socket_path),
            input=json.dumps(doc).encode(),
            capture_output=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()
        answer = json.loads(done.stdout)
        assert isinstance(answer, dict)
        return answer

    def ok(self, doc: dict[str, Any]) -> dict[str, Any]:
        answer = self.call(doc)
        assert answer["ok"] is True, answer
        return dict(answer["result"])

    def refused(self, doc: dict[str, Any], reason: str, text: str = "") -> dict[str, Any]:
        """`doc`, sent as the node, is refused for `reason`, audited as the next line, and changes nothing
        under the simulated root."""
        before = tree(self.root)
        seq = self.h.last_audit()["seq"]
        answer = self.call(doc)
        assert (answer["ok"], answer.get("error"), answer.get("reason")) == (False, "refused", reason), answer
        assert text in answer["message"], answer
        last = self.h.last_audit()
        assert (last["seq"], last["decision"], last["reason"], last["peer_uid"]) == (
            seq + 1,
            "refused",
            reason,
            self.uid,
        )
        assert tree(self.root) == before
        return answer

    def close(self) -> None:
        if self.helper is not None:
            self.helper.stop()
        self.user.remove()
        shutil.rmtree(self.parent, ignore_errors=True)
