"""A bounded set of recent keys: stops that may arrive before what they stop, and are
forgotten oldest first once the work they named has long ended."""

from __future__ import annotations

from collections.abc import Hashable

MAX_REMEMBERED = 10_000


class RecentKeys:
    """The last `limit` keys added (adding past the limit forgets the oldest)."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._keys: dict[Hashable, None] = {}
        self._limit = limit

    def add(self, key: Hashable) -> None:
        """Remember key (again: it becomes the newest)."""
        self._keys.pop(key, None)
        self._keys[key] = None
        while len(self._keys) > self._limit:
            del self._keys[next(iter(self._keys))]

    def discard(self, key: Hashable) -> None:
        """Forget key if remembered."""
        self._keys.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)
