"""A prefill worker's handoff table: what a late Read gets, before and after the reaper, and
what an early Read (sent before prefill computed the handoff) waits for."""

from __future__ import annotations

import threading
import time

from kvdisagg.transport.handoffs import HandoffTable


def test_read_past_the_lease_is_served_until_the_handoff_is_freed():
    table = HandoffTable()
    table.add("r1", "tok", [3, 4], lease_s=0.01)
    time.sleep(0.03)  # the lease ran out, but nothing freed the blocks yet
    assert table.pin("r1", "tok", [3, 4], wait_s=0) == ("", (3, 4))
    table.unpin("r1")
    assert table.take_finished() == set()  # the late Read restarted the lease
    assert table.pin("r1", "wrong", [3, 4], wait_s=0)[0].startswith("wrong token")
    assert "not part of" in table.pin("r1", "tok", [5], wait_s=0)[0]


def test_read_after_the_reaper_freed_it_is_refused():
    table = HandoffTable()
    table.add("r1", "tok", [3], lease_s=0.01)
    time.sleep(0.03)
    assert table.take_finished() == {"r1"}
    assert table.expired_unread == 1
    assert "expired unread" in table.pin("r1", "tok", [3], wait_s=0)[0]
    table.add("r2", "tok", [5], lease_s=30)
    assert table.release("r2", "tok")
    assert "already released" in table.pin("r2", "tok", [5], wait_s=0)[0]


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
    assert table.take_finished() == set() and table.pin("r1", "tok", [3], wait_s=0)[0] == ""
    table.unpin("r1")
    assert table.release("r1", "tok", readers=2)
    assert table.take_finished() == {"r1"}
    table.add("r2", "tok", [4], lease_s=30)
    assert table.release("r2", "tok", readers=4, force=True)  # decode gave it up: at once
    assert table.take_finished() == {"r2"}


def _pin_later(table: HandoffTable, *args, **kw) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(table.pin(*args, **kw)))
    t.start()
    return t, got


def test_an_early_read_waits_while_expected_and_gets_the_blocks_by_position():
    table = HandoffTable()
    keepalives = []
    t, got = _pin_later(table, "early-1", "tok", [], 1.0, lambda: keepalives.append(1),
                        first_block=1, count=2, early_grace_s=0.2)
    table.expect("early-1", "tok")
    time.sleep(0.5)  # past the grace: expected, so it still waits (prefill is computing)
    assert t.is_alive() and keepalives
    assert table.add("early-1", "tok", [7, 8, 9], lease_s=30)
    t.join(2)
    assert got == [("", (8, 9))]  # blocks 1..2 of the handoff, in prompt order
    table.unpin("early-1")
    assert "holds 3" in table.pin("early-1", "tok", [], 0, first_block=2, count=2)[0]
    assert "wrong token" in table.pin("early-1", "bad", [], 0, first_block=0, count=1)[0]
    assert not table.add("early-1", "tok2", [1], lease_s=30)  # a second offer: refused


def test_an_early_read_of_a_forgotten_or_never_expected_handoff_is_refused():
    table = HandoffTable()
    table.expect("early-2", "tok")
    t, got = _pin_later(table, "early-2", "tok", [], 10.0, first_block=0, count=1,
                        early_grace_s=5.0)
    time.sleep(0.1)
    table.forget("early-2", "not offered: prefill's request ended FINISHED_ABORTED")
    t.join(2)
    assert got and "FINISHED_ABORTED" in got[0][0]
    start = time.monotonic()  # never expected: refused once the grace is over
    assert "unknown" in table.pin("early-3", "tok", [], 10.0, first_block=0, count=1,
                                  early_grace_s=0.3)[0]
    assert 0.3 <= time.monotonic() - start < 2


def test_an_early_handoff_released_before_its_offer_is_freed_when_offered():
    """Decode gave up the request while prefill computed it: the offer that follows is freed
    at the next reap instead of holding prefill's blocks for a lease."""
    table = HandoffTable()
    table.expect("early-4", "tok")
    assert not table.release("early-4", "wrong")
    assert table.release("early-4", "tok")
    assert table.add("early-4", "tok", [3], lease_s=30)
    assert table.take_finished() == {"early-4"} and table.expired_unread == 0
    # Given up before its request even reached prefill: a Read waiting for it is refused now.
    t, got = _pin_later(table, "early-5", "tok", [], 10.0, first_block=0, count=1,
                        early_grace_s=10.0)
    time.sleep(0.1)
    assert table.release("early-5", "tok")
    t.join(2)
    assert got and "released by decode" in got[0][0]
    table.expect("early-5", "tok")  # its request comes after all: nothing waits for it
    assert table.add("early-5", "tok", [4], lease_s=30)
    assert table.take_finished() == {"early-5"}
