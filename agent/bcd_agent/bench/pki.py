"""`bcd bench pki`: signature and chain verification throughput (docs/pki.md, "Cache and speed").

Measures, on a fresh in-memory hierarchy (root -> intermediate -> worker leaf):
- `ed25519_verify_per_s`: verify_signature over a 1 KiB body under purpose `command`;
- `chain_verify_per_s`: verify_chain without a cache (every link checked by hand);
- `command_verify_cached_per_s`: verify_command with a ChainCache hit (one chain hash + one verify).
"""

from __future__ import annotations

import argparse
import datetime
import time
from collections.abc import Callable

from bcd_shared.pki import (
    ChainCache,
    KeyPair,
    Purpose,
    Role,
    Roots,
    issue_intermediate,
    issue_leaf,
    issue_root,
    verify_chain,
    verify_command,
    verify_signature,
)

# Informational: docs/pki.md gives the orders of magnitude, no target.
TARGETS: dict[str, tuple[str, float]] = {}


def _rate(call: Callable[[], object], seconds: float = 0.5) -> float:
    count = 0
    start = time.perf_counter()
    deadline = start + seconds
    while time.perf_counter() < deadline:
        for _ in range(50):
            call()
        count += 50
    return count / (time.perf_counter() - start)


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)
    root_key, ca_key, worker_key = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    root = issue_root(root_key, "bench root", now - day, now + day)
    inter = issue_intermediate(root, root_key, ca_key.public_key, "bench CA", now - day, now + day)
    leaf = issue_leaf(inter, ca_key, worker_key.public_key, Role.WORKER, "worker", now - day, now + day)
    roots = Roots.from_ders([root])
    chain = (leaf, inter)
    body = bytes(1024)
    sig = worker_key.sign(Purpose.COMMAND, body)
    cache = ChainCache()
    return {
        "ed25519_verify_per_s": round(
            _rate(lambda: verify_signature(worker_key.public_key, Purpose.COMMAND, body, sig))
        ),
        "chain_verify_per_s": round(_rate(lambda: verify_chain(chain, roots, Purpose.COMMAND, now))),
        "command_verify_cached_per_s": round(
            _rate(lambda: verify_command(body, sig, chain, roots, now, cache))
        ),
    }
