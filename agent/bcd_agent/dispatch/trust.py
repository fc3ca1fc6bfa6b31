"""The dispatcher's trust ports on top of bcd_shared.pki: command signatures, the quorum, node signatures.

`BundleTrust` holds the current verified TrustBundle (the session replaces it when a newer one is accepted)
and answers the acceptance checks' two questions: must commands be signed, and does this one verify
(DLV-SIG-01..05); is the quorum on, and does this batch approval and scope proof admit this command
(DLV-QRM-01). Whether a signature is required depends only on the bundle, never on the body (DLV-SIG-03).

`NodeResultSigner` signs attested results with the node key (DLV-SIG-17; layout in bcd_shared.pki.attest).
"""

from __future__ import annotations

import datetime as dt

from bcd_shared.pki import Roots, TrustBundle, attest_command_result
from bcd_shared.pki.chain import ChainCache
from bcd_shared.pki.quorum import admit_batched_command, decode_scope
from bcd_shared.pki.signing import KeyPair
from bcd_shared.pki.verify import verify_command

from bcd_agent.dispatch.command import CommandEnvelope, UpdateState
from bcd_agent.dispatch.ports import BatchAdmission
from bcd_agent.dispatch.wire import UPDATE_STATE_TO_WIRE, approval_to_wire, proof_to_wire


class BundleTrust:
    """TrustView and BatchVerifier over the current trust bundle (None: no bundle yet, nothing enforced)."""

    def __init__(self, bundle: TrustBundle | None = None, cache: ChainCache | None = None) -> None:
        self._bundle = bundle
        self._cache = cache if cache is not None else ChainCache()
        # The roots parsed once per bundle (parsing the certificates was half a command's verify).
        self._roots: Roots | None = None

    @property
    def bundle(self) -> TrustBundle | None:
        return self._bundle

    def set_bundle(self, bundle: TrustBundle) -> None:
        self._bundle = bundle
        self._roots = None

    def has_command_roots(self) -> bool:
        return self._bundle is not None and self._bundle.has_command_roots

    def verify_command(self, command: CommandEnvelope, now: dt.datetime) -> None:
        if self._bundle is None:
            raise ValueError("no trust bundle")
        if self._roots is None:
            self._roots = self._bundle.command_root_set()
        verify_command(
            command.body_bytes,
            command.signature,
            command.signer_chain,
            self._roots,
            now,
            self._cache,
        )

    def has_approvers(self) -> bool:
        return self._bundle is not None and self._bundle.has_quorum

    def unbatched_allowance(self) -> int:
        return 0 if self._bundle is None else self._bundle.unbatched_destructive_per_hour

    def admit(self, command: CommandEnvelope, now: dt.datetime) -> BatchAdmission:
        if self._bundle is None:
            raise ValueError("no trust bundle")
        if command.batch_approval is None:
            raise ValueError("the command carries no batch_approval")
        if command.batch_proof is None:
            raise ValueError("the command carries no batch_proof")
        proven = admit_batched_command(
            approval_to_wire(command.batch_approval),
            proof_to_wire(command.batch_proof),
            self._bundle,
            now,
            batch_id=command.batch_id,
            command_id=command.id,
            subject=command.subject,
            kind=command.kind,
            payload=command.payload.value,
        )
        scope_end = decode_scope(command.batch_approval.scope).not_after
        return BatchAdmission(
            leaf=f"{proven.batch_id}/{proven.leaf_id}",
            expires_at=scope_end / 1000 if scope_end else None,
        )


class NodeResultSigner:
    """ResultSigner with the node key."""

    def __init__(self, node_key: KeyPair, node_id: str) -> None:
        self._key = node_key
        self._node_id = node_id

    def attest(self, command_id: str, state: UpdateState, result: bytes, boot_id: str) -> tuple[bytes, bytes]:
        return attest_command_result(
            self._key, command_id, UPDATE_STATE_TO_WIRE[state], result, self._node_id, boot_id
        )
