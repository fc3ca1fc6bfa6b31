"""The devplane store's batch: the messages of one received batch share one commit; a message whose
transaction fails is rolled back alone (a savepoint), and what the others wrote is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
from bcd_agent.devplane.store import Store


def test_a_failing_transaction_inside_a_batch_rolls_back_alone(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(RuntimeError), store.batch():
        with store.tx() as c:
            c.execute("INSERT INTO kv (key, value) VALUES ('a', 1)")
        with pytest.raises(ValueError), store.tx() as c:
            c.execute("INSERT INTO kv (key, value) VALUES ('b', 2)")
            raise ValueError("this message is refused")
        with store.tx() as c:
            c.execute("INSERT INTO kv (key, value) VALUES ('c', 3)")
        raise RuntimeError("the batch ends the session after its messages")
    assert store.depth == 0
    store.close()
    reopened = Store(tmp_path)
    assert [r[0] for r in reopened.all("SELECT key FROM kv ORDER BY key")] == ["a", "c"]


def test_a_plain_transaction_still_rolls_back_on_failure(tmp_path: Path) -> None:
    store = Store(tmp_path)
    with pytest.raises(ValueError), store.tx() as c:
        c.execute("INSERT INTO kv (key, value) VALUES ('a', 1)")
        raise ValueError("x")
    assert store.all("SELECT key FROM kv") == [] and store.depth == 0
