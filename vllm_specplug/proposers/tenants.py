"""Cross-request memory kept apart by tenant (docs/security.md).

A proposer that drafts one request from other requests' text (``sam``'s
global store, Token Recycling's adjacency) keeps one partition per tenant key
(``RequestInfo.tenant``: the adapter makes it from the request's
``cache_salt`` and LoRA adapter), so requests of different tenants never
draft from each other's text. ``Partitions`` holds them: at most
``max_partitions``, the least recently used dropped whole beyond that.
``TenantStores`` adds the global store's shared budget: the stores of all
tenants together hold at most ``max_tokens`` tokens and the bytes one full
store would hold; past either, the least recently used other tenant's store
is dropped whole.

A request keeps reading the partition it started with even if that is
dropped meanwhile (it holds a reference); nothing new is added to a dropped
partition, and it is freed when its last request finishes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, Iterator, TypeVar

T = TypeVar("T")


class Partitions(Generic[T]):
    """Key -> partition, least recently used first; ``get`` creates a missing
    one with ``factory`` and drops the least recently used beyond
    ``max_partitions``."""

    def __init__(self, factory: Callable[[], T], max_partitions: int) -> None:
        if max_partitions < 1:
            raise ValueError(f"max_partitions must be at least 1, got {max_partitions}")
        self.factory = factory
        self.max_partitions = int(max_partitions)
        self._parts: OrderedDict[Hashable, T] = OrderedDict()
        self.dropped = 0

    def get(self, key: Hashable, create: bool = True) -> T | None:
        part = self._parts.get(key)
        if part is not None:
            self._parts.move_to_end(key)
            return part
        if not create:
            return None
        part = self._parts[key] = self.factory()
        while len(self._parts) > self.max_partitions:
            self.drop_oldest()
        return part

    def peek(self, key: Hashable) -> T | None:
        """The partition of ``key`` without touching the order (None: none)."""
        return self._parts.get(key)

    def drop_oldest(self, keep: Hashable = None) -> bool:
        """Drop the least recently used partition other than ``keep``; False
        when there is none."""
        for key in self._parts:
            if key != keep:
                del self._parts[key]
                self.dropped += 1
                return True
        return False

    def clear(self) -> None:
        self._parts.clear()

    def __len__(self) -> int:
        return len(self._parts)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._parts

    def items(self) -> Iterator[tuple[Hashable, T]]:
        return iter(list(self._parts.items()))

    def values(self) -> Iterator[T]:
        return iter(list(self._parts.values()))


class TenantStores(Partitions):
    """One ``GlobalStore`` per tenant key under one budget: at most
    ``max_partitions`` stores, ``max_tokens`` tokens and the bytes of one full
    store in all (each store alone may hold ``max_tokens``)."""

    def __init__(self, max_tokens: int, max_partitions: int) -> None:
        from .global_store import GlobalStore

        self.max_tokens = int(max_tokens)
        super().__init__(lambda: GlobalStore(self.max_tokens), max_partitions)
        # what one full store can hold (the stores are made when a document
        # arrives; the untouched pages of a fresh segment cost nothing)
        self.max_nbytes = GlobalStore(self.max_tokens).max_nbytes()

    def add(self, key: Hashable, tokens) -> None:
        """Add a document to ``key``'s store, then drop other tenants' stores,
        least recently used first, while the total is over the budget."""
        store = self.get(key)
        store.add(tokens)
        while (self.num_tokens > self.max_tokens or self.resident_nbytes() > self.max_nbytes) \
                and self.drop_oldest(keep=key):
            pass

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.values())

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.values())

    def resident_nbytes(self) -> int:
        return sum(s.resident_nbytes() for s in self.values())

    def allocated_nbytes(self) -> int:
        return sum(s.allocated_nbytes() for s in self.values())
