"""A prefill worker's handoff table: what a late Read gets, before and after the reaper."""

from __future__ import annotations

import time

from kvdisagg.transport.handoffs import HandoffTable


def test_read_past_the_lease_is_served_until_the_handoff_is_freed():
    table = HandoffTable()
    table.add("r1", "tok", [3, 4], lease_s=0.01)
    time.sleep(0.03)  # the lease ran out, but nothing freed the blocks yet
    assert table.pin("r1", "tok", [3, 4], wait_s=0) == ""
    table.unpin("r1")
    assert table.take_finished() == set()  # the late Read restarted the lease
    assert table.pin("r1", "wrong", [3, 4], wait_s=0).startswith("wrong token")
    assert "not part of" in table.pin("r1", "tok", [5], wait_s=0)


def test_read_after_the_reaper_freed_it_is_refused():
    table = HandoffTable()
    table.add("r1", "tok", [3], lease_s=0.01)
    time.sleep(0.03)
    assert table.take_finished() == {"r1"}
    assert table.expired_unread == 1
    assert "expired unread" in table.pin("r1", "tok", [3], wait_s=0)
    table.add("r2", "tok", [5], lease_s=30)
    assert table.release("r2", "tok")
    assert "already released" in table.pin("r2", "tok", [5], wait_s=0)


def test_renewal_past_the_lease_counts_until_the_handoff_is_freed():
    """A decode slow to get its first Renew through (a starved host) keeps its handoff, as a
    late Read does; once freed, a renewal changes nothing."""
    table = HandoffTable()
    table.add("r1", "tok", [3], lease_s=0.01)
    time.sleep(0.03)
    assert table.renew([("r1", "wrong")]) == 0
    assert table.renew([("r1", "tok")]) == 1
    assert table.take_finished() == set()
    time.sleep(0.03)
    assert table.take_finished() == {"r1"}
    assert table.renew([("r1", "tok")]) == 0


def test_a_handoff_read_by_two_decode_workers_is_freed_after_both():
    table = HandoffTable()
    table.add("r1", "tok", [3], lease_s=30)
    assert table.release("r1", "tok", readers=2)
    assert table.take_finished() == set() and table.pin("r1", "tok", [3], wait_s=0) == ""
    table.unpin("r1")
    assert table.release("r1", "tok", readers=2)
    assert table.take_finished() == {"r1"}
    table.add("r2", "tok", [4], lease_s=30)
    assert table.release("r2", "tok", readers=4, force=True)  # decode gave it up: at once
    assert table.take_finished() == {"r2"}
