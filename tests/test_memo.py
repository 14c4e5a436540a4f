"""The process-wide memos: a bounded LRU, and memos keyed on cached objects that never answer for another object
that happens to reuse a freed one's id."""

from __future__ import annotations

from workbench.memo import LRU, remember_by_identity, remember_while_same


def test_lru_keeps_the_most_recent() -> None:
    cache = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3 and len(cache) == 2


def test_a_hit_needs_the_same_objects_not_just_their_ids() -> None:
    cache = LRU(4)
    anchor, calls = object(), []
    assert remember_by_identity(cache, (anchor,), "x", lambda: calls.append(1) or "first") == "first"
    assert remember_by_identity(cache, (anchor,), "x", lambda: calls.append(1) or "again") == "first"
    impostor = object()
    cache.put((id(impostor), "x"), ((anchor,), "stale"))  # as if impostor had reused a freed anchor's id
    assert remember_by_identity(cache, (impostor,), "x", lambda: "fresh") == "fresh"
    assert calls == [1]


def test_a_value_is_kept_while_its_snapshot_compares_equal() -> None:
    cache, calls = LRU(2), []
    table = {"a": 1}

    def compute() -> int:
        calls.append(1)
        return sum(table.values())

    assert remember_while_same(cache, table, (table,), compute) == 1
    assert remember_while_same(cache, table, (table,), compute) == 1 and len(calls) == 1
    table["b"] = 2  # the same object, changed in place: computed again
    assert remember_while_same(cache, table, (table,), compute) == 3 and len(calls) == 2
    other = {"a": 1, "b": 2}  # an equal object is another anchor
    assert remember_while_same(cache, other, (other,), compute) == 3 and len(calls) == 3
