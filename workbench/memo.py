"""Bounded process-wide memos: what a repeat save or load finds already computed.

``LRU`` is a thread-safe least-recently-used map. ``remember_by_identity`` keys a memo on objects that are
themselves cached elsewhere (a plan set, a key-metadata map): their ids are the key, and a hit counts only while
they are the same objects (an id reused after one was freed is a miss, not a wrong answer).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["LRU", "remember_by_identity", "remember_while_same"]

_T = TypeVar("_T")


class LRU:
    """A bounded least-recently-used map, safe to use from several threads (``None`` values are not stored)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> Any:
        """The value under ``key`` (now the most recent), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: Hashable, value: Any) -> None:
        """Store ``value`` under ``key``, dropping the least recently used entries past ``maxsize``."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry and reset the counters."""
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._data)


def remember_by_identity(
    cache: LRU, anchors: Sequence[Any], extra: Hashable, compute: Callable[[], _T]
) -> _T:
    """``compute()`` once per (the very objects ``anchors``, ``extra``), kept in ``cache``."""
    key = (*map(id, anchors), extra)
    hit = cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], anchors)):
        return hit[1]
    value = compute()
    cache.put(key, (tuple(anchors), value))
    return value


def remember_while_same(cache: LRU, anchor: Any, state: tuple[Mapping[Any, Any], ...], compute: Callable[[], _T]) -> _T:
    """``compute()`` once per the very object ``anchor`` while the mappings ``state`` (those inside it that can change
    in place) hold what they held when it was computed: a hit compares them live with copies kept then (no copy on
    a hit); kept in ``cache``."""
    known = cache.get(id(anchor))
    if known is not None and known[0] is anchor and known[1] == state:
        return known[2]
    value = compute()
    cache.put(id(anchor), (anchor, tuple(dict(m) for m in state), value))
    return value
