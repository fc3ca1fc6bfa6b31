"""The node's SecretRequest/SecretResponse (session.secrets) and the devplane broker's binding rule.

Covers HST-K8S-50 (the token is asked with workflow `host:k8s-join`, step `tokenRef`), HST-K8S-51 (the
broker releases it only while the current spec names it in k8s-join's tokenRef) and DLV-INST-08's rule
for every asker (an unavailable broker is retryable).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from bcd_agent.devplane.plane import DevPlane
from bcd_agent.session.secrets import (
    STEP_TOKEN_REF,
    WORKFLOW_K8S_JOIN,
    SecretRequests,
    SessionTokenSource,
)
from bcd_shared import wire
from bcd_shared.errors import RetryableError, TerminalError
from bcd_shared.pki import KeyPair

REF = "secret://pool/k8s-token"


class Gateway:
    """Stands for the other end of the session: records requests, answers when told."""

    def __init__(self) -> None:
        self.requests: list[wire.SecretRequest] = []
        self.arrived = trio.Event()

    def send(self, message: wire.NodeMessage) -> None:
        assert message.secret_request is not None
        self.requests.append(message.secret_request)
        self.arrived.set()

    async def next_request(self) -> wire.SecretRequest:
        await self.arrived.wait()
        self.arrived = trio.Event()
        return self.requests[-1]


def response(
    request: wire.SecretRequest, status: wire.SecretStatus, value: bytes = b"", message: str = ""
) -> wire.SecretResponse:
    return wire.SecretResponse(request_id=request.request_id, status=status, value=value, message=message)


async def _fetch(requests: SecretRequests, out: dict[str, object], **kw: object) -> None:
    try:
        out["value"] = await requests.fetch(REF, workflow_id=WORKFLOW_K8S_JOIN, step_id=STEP_TOKEN_REF, **kw)  # type: ignore[arg-type]
    except (TerminalError, RetryableError) as exc:
        out["error"] = exc


async def test_HST_K8S_50_ok_returns_the_value_and_names_the_workflow_step() -> None:
    requests, gw, out = SecretRequests(), Gateway(), {}
    requests.welcomed(gw.send)
    async with trio.open_nursery() as n:
        n.start_soon(_fetch, requests, out)
        req = await gw.next_request()
        assert (req.ref, req.workflow_id, req.step_id) == (REF, "host:k8s-join", "tokenRef")
        assert requests.deliver(response(req, wire.SecretStatus.OK, b"abcdef.0123456789abcdef"))
    assert out == {"value": b"abcdef.0123456789abcdef"}
    assert requests.pending == 0


async def test_refused_is_terminal_unavailable_is_retryable() -> None:
    for status, kind in (
        (wire.SecretStatus.REFUSED, TerminalError),
        (wire.SecretStatus.UNAVAILABLE, RetryableError),
    ):
        requests, gw, out = SecretRequests(), Gateway(), {}
        requests.welcomed(gw.send)
        async with trio.open_nursery() as n:
            n.start_soon(_fetch, requests, out)
            req = await gw.next_request()
            requests.deliver(response(req, status, message="not named by the spec"))
        error = out["error"]
        assert type(error) is kind, error
        assert REF in str(error) and "not named by the spec" in str(error)


async def test_no_answer_in_time_is_retryable_and_a_late_answer_is_dropped(
    autojump_clock: trio.abc.Clock,
) -> None:
    requests, gw, out = SecretRequests(timeout_s=5), Gateway(), {}
    requests.welcomed(gw.send)
    await _fetch(requests, out)
    assert isinstance(out["error"], RetryableError) and "within 5 s" in str(out["error"])
    assert not requests.deliver(response(gw.requests[0], wire.SecretStatus.OK, b"late"))


async def test_waits_for_the_welcome_and_asks_again_after_a_lost_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    requests, gw, out = SecretRequests(), Gateway(), {}
    async with trio.open_nursery() as n:
        n.start_soon(_fetch, requests, out)
        await trio.sleep(1)
        assert gw.requests == []  # nothing before a Welcome
        requests.welcomed(gw.send)
        first = await gw.next_request()
        requests.detached()  # the connection ended before the answer
        await trio.sleep(1)
        requests.welcomed(gw.send)
        second = await gw.next_request()
        assert second.request_id != first.request_id and second.ref == first.ref
        assert not requests.deliver(response(first, wire.SecretStatus.OK, b"old session"))
        requests.deliver(response(second, wire.SecretStatus.OK, b"v"))
    assert out == {"value": b"v"}


async def test_token_source_fetches_from_a_worker_thread() -> None:
    requests, gw = SecretRequests(), Gateway()
    requests.welcomed(gw.send)
    source = SessionTokenSource(requests, trio.lowlevel.current_trio_token())
    got: list[str] = []
    async with trio.open_nursery() as n:
        n.start_soon(trio.to_thread.run_sync, lambda: got.append(source.fetch(REF)))
        req = await gw.next_request()
        requests.deliver(response(req, wire.SecretStatus.OK, b"abcdef.0123456789abcdef\n"))
    assert got == ["abcdef.0123456789abcdef"] and source.fetched == [REF]


def _joined(plane: DevPlane) -> str:
    resp = plane.join(
        wire.JoinRequest(
            token=plane.issue_token(), node_public_key=KeyPair.generate().public_key, hostname="h"
        )
    )
    return wire.JoinResponseBody.parse(resp.body).node_id


def _k8s(ref: str) -> dict[str, object]:
    settings = {"server": "https://10.0.0.1:6443", "caCertSha256": "ab" * 32, "tokenRef": ref}
    return {"host": {"units": [{"name": "k8s-join", "settings": json.dumps(settings, sort_keys=True)}]}}


@pytest.mark.parametrize(
    ("spec", "workflow", "step", "expected"),
    [
        (_k8s(REF), WORKFLOW_K8S_JOIN, STEP_TOKEN_REF, wire.SecretStatus.OK),
        (_k8s("secret://other"), WORKFLOW_K8S_JOIN, STEP_TOKEN_REF, wire.SecretStatus.REFUSED),
        (_k8s(REF), WORKFLOW_K8S_JOIN, "userData", wire.SecretStatus.REFUSED),
        # Named elsewhere in the spec, not in k8s-join's tokenRef: not released for the join.
        (
            {"telemetry": {"headersSecretRef": REF}},
            WORKFLOW_K8S_JOIN,
            STEP_TOKEN_REF,
            wire.SecretStatus.REFUSED,
        ),
        # Without the workflow, a reference inside a unit's settings counts as named.
        (_k8s(REF), "", "", wire.SecretStatus.OK),
        ({}, WORKFLOW_K8S_JOIN, STEP_TOKEN_REF, wire.SecretStatus.REFUSED),
    ],
)
def test_HST_K8S_51_broker_releases_the_token_only_while_k8s_join_names_it(
    tmp_path: Path, spec: dict[str, object], workflow: str, step: str, expected: wire.SecretStatus
) -> None:
    plane = DevPlane(tmp_path / "dp", listen=None)
    node = _joined(plane)
    plane.put_secret(REF, b"abcdef.0123456789abcdef")
    plane.apply_spec(node, spec)
    answer = plane.secret(
        node, wire.SecretRequest(request_id="r1", ref=REF, workflow_id=workflow, step_id=step)
    )
    assert answer.status == expected and answer.request_id == "r1"
    if expected == wire.SecretStatus.OK:
        assert answer.value == b"abcdef.0123456789abcdef"
