"""LruOrder: keys in least-recently-used order, the ordering the LRU-like caches share: ARC's
four lists (moecache.core.policies.Arc), the global model's LRU (moecache.offline.budget), and
upstream llama.cpp's slot LRU and ClassLRU's lists (moecache.offline.upstream). Each keeps its
own keys (experts, (layer, expert) keys, slots) and its own counts; the order is this one.

Two LRUs keep a form of their own, for speed: the per-layer Lru policy ranks the residents by
each expert's last use (a numpy array over every layer: the engine asks for priorities in bulk),
and stock mmap's page cache (moecache.offline.pagecache) keeps millions of pages in a numpy log.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable


class LruOrder:
    """Keys, least recently used first."""

    def __init__(self):
        self._order: OrderedDict = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key) -> bool:
        return key in self._order

    def __iter__(self):
        """The keys, least recently used first."""
        return iter(self._order)

    def use(self, key: Hashable) -> None:
        """key becomes the most recently used (added if it is not here)."""
        self.use_all((key,))

    def use_all(self, keys: Iterable) -> None:
        """Each key used in turn (added if it is not here): the last ends the most recently used."""
        order = self._order
        for key in keys:
            order[key] = None
            order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def oldest(self, spared=()) -> Hashable | None:
        """The least recently used key not in `spared`; None when every key is spared."""
        return next((key for key in self._order if key not in spared), None)

    def pop_oldest(self) -> Hashable:
        return self._order.popitem(last=False)[0]
