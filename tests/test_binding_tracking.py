"""The table of instances a binding was made for (``instances._instances``, what ``uninstall`` detaches):
an entry goes only when its object is gone, even when a new object reuses a gone one's id."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from omni_accum.integrations.vllm_omni import binding, instances


class _Adapter:
    pass


class _Interleaving(dict):
    """An instance table whose first ``get`` of ``key`` lets ``meanwhile`` run after the lookup, before the
    caller goes on: another thread acting between a clean-up's lookup and its removal."""

    def __init__(self, base: dict, key: int, meanwhile) -> None:
        super().__init__(base)
        self.key, self.meanwhile = key, meanwhile
        self.locked: list[bool] = []  # whether ``instances._lock`` was held at each lookup of ``key``

    def get(self, key, default=None):
        found = super().get(key, default)
        if key == self.key:
            self.locked.append(instances._lock.locked())
        if key == self.key and self.meanwhile is not None:
            run, self.meanwhile = self.meanwhile, None
            run()
        return found


@pytest.fixture
def fresh_table(monkeypatch):
    monkeypatch.setattr(instances, "_instances", {})
    monkeypatch.setattr(instances, "_gone", [])
    return instances


def test_a_gone_object_leaves_the_table_at_the_next_track(fresh_table):
    a, b = _Adapter(), _Adapter()
    with instances._lock:
        instances._track(a)
        instances._track(b)
    key = id(a)
    keep = _Adapter()  # made before ``a`` goes, so that it cannot take ``a``'s id
    del a
    gc.collect()
    assert instances._gone == [key]
    with instances._lock:
        instances._track(keep)
    assert key not in instances._instances and id(b) in instances._instances
    assert instances._gone == []


def test_a_new_object_reusing_a_gone_ones_id_keeps_its_entry(fresh_table):
    """Another thread tracks a new object under the id of one just gone, between the clean-up's lookup
    and its removal. The clean-up runs under ``_lock``, as tracking does, so the newcomer's entry is made
    after it and stays (the old weakref callback ran without the lock and popped the newcomer's entry)."""
    a = _Adapter()
    assert binding.binding_for(a) is None  # no policy: tracked all the same (uninstall detaches what it bound)
    key = id(a)
    assert key in instances._instances
    newcomer = _Adapter()

    def track_newcomer() -> None:  # what binding_for does for a new object whose id is the gone one's
        with instances._lock:
            instances._instances[key] = weakref.ref(newcomer)

    other = threading.Thread(target=track_newcomer)
    table = instances._instances = _Interleaving(instances._instances, key, lambda: (other.start(), other.join(0.2)))
    del a
    gc.collect()
    binding.binding_for(keep := _Adapter())  # a first send of a new adapter: the clean-up runs in there
    other.join(10)
    assert not other.is_alive()
    assert table.locked == [True]  # the clean-up's lookup ran under the lock
    assert instances._instances[key]() is newcomer
    assert instances._instances[id(keep)]() is keep


def test_an_object_tracked_twice_is_one_entry_and_leaves_once(fresh_table):
    a = _Adapter()
    with instances._lock:
        instances._track(a)
        instances._track(a)
    assert list(instances._instances) == [id(a)]
    del a
    gc.collect()
    with instances._lock:
        instances._track(keep := _Adapter())
    assert list(instances._instances) == [id(keep)]
