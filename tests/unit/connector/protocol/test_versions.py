"""The protocol's versions (kvdisagg/connector/protocol/versions.py): two instances speak the
highest version both speak, and this release speaks its range."""

import pytest

from kvdisagg.connector.protocol.versions import (
    EARLY_HANDOFF_VERSION,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    SPOKEN,
    Versions,
    spoken,
)


@pytest.mark.parametrize("a, b, common", [
    ((4, 5), (4, 5), 5),
    ((4, 5), (5, 5), 5),
    ((4, 5), (4, 4), 4),
    ((4, 4), (5, 6), None),
    ((5, 6), (4, 5), 5),
    ((6, 6), (4, 5), None),
])
def test_two_instances_speak_the_highest_version_both_speak(a, b, common):
    assert Versions(*a).common(Versions(*b)) == common
    assert Versions(*b).common(Versions(*a)) == common


def test_this_release_speaks_its_range_and_an_override_narrows_it_to_one():
    assert spoken() == SPOKEN == Versions(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
    assert MIN_PROTOCOL_VERSION <= EARLY_HANDOFF_VERSION <= PROTOCOL_VERSION
    assert spoken(7) == Versions(7, 7) and str(spoken(7)) == "7" and str(SPOKEN) == "4..5"
