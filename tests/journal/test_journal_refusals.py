"""Rows on the gateway's word alone (hostile gateway, round 2; docs/journal.md "Commands and the Resolve
table"): refusals not judged on a verified signature and cancels of commands never accepted. What such a
refusal answers (`envelope_sha256`), what a refusal of a verified command keeps (`signed`), and their bound
(`max_refused`) at its exact edges."""

from __future__ import annotations

from pathlib import Path

import pytest
from bcd_agent.journal import (
    MAX_REFUSED_ROWS,
    Action,
    BoundError,
    CommandFlags,
    CommandState,
    Journal,
    RefusalsFull,
)
from jhelpers import Clock, cmd

D1, D2 = b"\x01" * 32, b"\x02" * 32


def test_a_refusal_on_the_gateways_word_answers_only_its_envelope(tmp_path: Path) -> None:
    """The same envelope resolves DONE (the same answer, DLV-ACK-17); another envelope under the id is
    judged afresh (NONE, the entry given); a caller with no envelope (a Cancel) gets DONE. Its flags are
    cleared (no attester call: the kind is the body's unverified claim) and it keeps no body."""
    signed: list[str] = []
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        j.set_attester(lambda e: (signed.append(e.id), (b"att", b"sig"))[1])
        entry = j.reject(cmd("x", CommandFlags(attested=True)), "BAD_SIGNATURE", envelope_sha256=D1)
        assert (entry.flags, entry.body, entry.signature, entry.envelope_sha256) == (
            CommandFlags(),
            b"",
            b"",
            D1,
        )
        assert not entry.binds and signed == [] and entry.result is not None and not entry.result.node_sig
        assert j.resolve("x", D1).action is Action.DONE
        other = j.resolve("x", D2)
        assert other.action is Action.NONE and other.entry == entry
        assert j.resolve("x").action is Action.DONE
        # A second refusal on the gateway's word leaves the first; the first answer stays.
        assert j.reject(cmd("x"), "UNSUPPORTED", envelope_sha256=D2) == entry
        assert j.refused_rows == 1


def test_an_accepted_envelope_takes_a_refusal_on_the_gateways_word_over(tmp_path: Path) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        j.reject(cmd("x"), "BAD_SIGNATURE", envelope_sha256=D1)
        j.reject(cmd("y"), "BAD_SIGNATURE", envelope_sha256=D1)
        accepted = j.accept_command(cmd("x"))
        assert accepted.state is CommandState.ACCEPTED and j.get_command("x") == accepted
        [batch] = j.accept_commands([cmd("y")])
        assert not isinstance(batch, Exception) and batch.state is CommandState.ACCEPTED
        assert j.refused_rows == 0
        assert j.unacked_results() == ()  # the refusals' results are gone with their rows


def test_a_binding_refusal_replaces_one_on_the_gateways_word_and_a_signed_one_keeps_its_body(
    tmp_path: Path,
) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        j.reject(cmd("x"), "BAD_SIGNATURE", envelope_sha256=D1)
        signed = j.reject(cmd("x"), "UNSUPPORTED", "upgrade-only", signed=True)
        assert signed.binds and signed.result is not None and signed.result.code == "UNSUPPORTED"
        assert (signed.body, signed.signature) == (b"body:x", b"sig:x")
        assert j.get_command("x") == signed and j.refused_rows == 0
        assert j.resolve("x", D2).action is Action.DONE  # binds the id now
        unsigned = j.reject(cmd("z"), "EXPIRED")  # no roots in force: binds, no body
        assert unsigned.binds and unsigned.body == b"" and j.refused_rows == 1
        with pytest.raises(ValueError, match="envelope_sha256"):
            j.reject(cmd("w"), "EXPIRED", signed=True, envelope_sha256=D1)


def test_rows_on_the_gateways_word_at_exactly_their_bound(tmp_path: Path) -> None:
    """`max_refused` rows are written; one more raises RefusalsFull and writes nothing while none is acked;
    an ack (also one kept by `ack_results(defer=True)`) lets the next one in, deleting the oldest acked row;
    cancels of unseen ids count alike; the count is read again at open."""
    clock = Clock()
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b1", clock=clock, max_refused=3) as j:
        for i in range(3):
            clock.t += 1
            j.reject(cmd(f"r{i}"), "BAD_SIGNATURE", envelope_sha256=D1)
        assert j.refused_rows == 3
        with pytest.raises(RefusalsFull) as exc:
            j.reject(cmd("r3"), "BAD_SIGNATURE", envelope_sha256=D1)
        assert str(exc.value) == (
            "journal full: 3 refusals and cancels of commands never accepted are unacked (at most 3);"
            " acks must drain them"
        )
        with pytest.raises(RefusalsFull):
            j.cancel_new(cmd("c0"), "x")
        assert j.get_command("r3") is None and j.get_command("c0") is None
        j.ack_results(["r1", "r2"], defer=True)  # kept in memory, not yet written
        clock.t += 1
        j.cancel_new(cmd("c0"), "x")
        assert j.get_command("r1") is None and j.get_command("r2") is not None  # the oldest acked only
        assert j.get_command("r0") is not None  # unacked: never deleted
        assert j.refused_rows == 3
        j.accept_command(cmd("real"))  # accepted commands are not counted
    with Journal.open(data, boot_id="b1", max_refused=3) as j:
        assert j.refused_rows == 3


def test_max_refused_may_be_lowered_never_raised(tmp_path: Path) -> None:
    with pytest.raises(BoundError, match="max_refused: 10001 is above the contract's limit 10000"):
        Journal.open(tmp_path / "d", boot_id="b1", max_refused=MAX_REFUSED_ROWS + 1)


def test_a_binding_refusal_taking_a_row_over_at_the_bound_needs_no_room_and_the_full_message_counts_it(
    tmp_path: Path,
) -> None:
    """At the bound, a binding refusal that replaces a row on the gateway's word under its id takes that
    row's place (the count stays); with the bound lowered below the rows kept, it is RefusalsFull naming
    the count as it would be after the replaced row goes, and nothing changes."""
    data = tmp_path / "d"
    with Journal.open(data, boot_id="b1", max_refused=3) as j:
        for i in range(3):
            j.reject(cmd(f"r{i}"), "BAD_SIGNATURE", envelope_sha256=D1)
        taken = j.reject(cmd("r0"), "EXPIRED")
        assert taken.binds and taken.result is not None and taken.result.code == "EXPIRED"
        assert j.refused_rows == 3
    with Journal.open(data, boot_id="b1", max_refused=2) as j:
        with pytest.raises(RefusalsFull) as exc:
            j.reject(cmd("r1"), "EXPIRED")
        assert str(exc.value) == (
            "journal full: 2 refusals and cancels of commands never accepted are unacked (at most 2);"
            " acks must drain them"
        )
        assert j.get_command("r1") is not None and not j.get_command("r1").binds  # type: ignore[union-attr]
        assert j.refused_rows == 3


@pytest.mark.parametrize(("bound", "gone"), [(99, 1), (200, 2), (250, 2)])
def test_at_the_bound_a_hundredth_of_it_goes_at_once_oldest_acked_first(
    tmp_path: Path, bound: int, gone: int
) -> None:
    clock = Clock()
    with Journal.open(tmp_path / "d", boot_id="b1", clock=clock, max_refused=bound) as j:
        for i in range(bound):
            clock.t += 1
            j.reject(cmd(f"r{i:04}"), "BAD_SIGNATURE", envelope_sha256=D1)
        j.ack_results([f"r{i:04}" for i in range(bound)])
        j.reject(cmd("next"), "BAD_SIGNATURE", envelope_sha256=D1)
        assert j.refused_rows == bound - gone + 1
        kept = [f"r{i:04}" for i in range(bound) if j.get_command(f"r{i:04}") is not None]
        assert kept == [f"r{i:04}" for i in range(gone, bound)]


def test_a_rejection_is_refused_without_a_reason_and_keeps_no_result_body_and_no_message_by_default(
    tmp_path: Path,
) -> None:
    with Journal.open(tmp_path / "d", boot_id="b1") as j:
        with pytest.raises(ValueError) as no_reason:
            j.reject(cmd("x"), "")
        assert str(no_reason.value) == "reason: a rejection needs its reason"
        with pytest.raises(ValueError) as both:
            j.reject(cmd("x"), "EXPIRED", signed=True, envelope_sha256=D1)
        assert str(both.value) == "envelope_sha256: only for a refusal whose signature did not verify"
        assert j.get_command("x") is None
        entry = j.reject(cmd("x"), "EXPIRED", signed=True)
        assert entry.result is not None and (entry.result.body, entry.result.message) == (b"", "")


def test_the_envelope_digest_is_sha256_over_each_part_after_its_length_in_8_bytes_big_endian() -> None:
    """Journaled (`commands.envelope_sha256`): a later version must compute it alike, or a refusal kept
    across an upgrade answers no envelope."""
    import hashlib

    from bcd_agent.dispatch.command import envelope_sha256

    parts = [b"body", b"s" * 300, b"c1", b""]
    want = hashlib.sha256(b"".join(len(p).to_bytes(8, "big") + p for p in parts)).digest()
    assert envelope_sha256(parts[0], parts[1], parts[2:]) == want
