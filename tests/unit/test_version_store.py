"""A relay holds at most ``keep`` versions' memory, the one arriving included, and never drops the
newest complete version (the one rollouts load while the next arrives)."""

from __future__ import annotations

import pytest

from laminar.weights.manifest import layout
from laminar.weights.transfer import VersionStore


def _begin(store: VersionStore, version: int):  # type: ignore[no-untyped-def]
    manifest = layout([("w", "float32", [4], 16)], version)
    return store.begin(manifest, [(0, manifest.total_bytes)])


def _complete(store: VersionStore, version: int) -> None:
    vb = _begin(store, version)
    vb.mark_all()
    store.completed(vb)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_transfer_makes_room_first_and_keeps_the_newest_complete(keep: int) -> None:
    store = VersionStore(keep, shared=False)
    for version in range(1, 6):
        _complete(store, version)
        assert len(store.versions) <= keep
    assert sorted(store.versions) == list(range(6 - keep, 6))
    _begin(store, 6)  # arriving: counts toward keep, the newest complete stays
    assert 5 in store.versions and 6 in store.versions
    assert len(store.versions) == max(keep, 2)
    assert store.latest() is store.versions[5]
    vb = store.versions[6]
    vb.mark_all()
    store.completed(vb)
    assert sorted(store.versions) == list(range(7 - keep, 7))


def test_a_stale_partial_goes_before_a_complete_version() -> None:
    store = VersionStore(2, shared=False)
    _complete(store, 1)
    _begin(store, 2)  # its upstream died half-way
    _begin(store, 3)  # a newer version arrives: the partial goes, v1 (newest complete) stays
    assert sorted(store.versions) == [1, 3]
