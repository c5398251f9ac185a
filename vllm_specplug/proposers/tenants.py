"""Cross-request memory kept apart by tenant (docs/security.md).

A proposer that drafts one request from other requests' text (``sam``'s
global store, Token Recycling's adjacency) keeps one partition per tenant key
(``RequestInfo.tenant``: the adapter makes it from the request's
``cache_salt`` and LoRA adapter), so requests of different tenants never
draft from each other's text. ``Partitions`` holds them: at most
``max_partitions``, the least recently used dropped whole beyond that.
``TenantStores`` adds the global store's shared budget: the stores of all
tenants together hold at most ``max_tokens`` tokens and the bytes one full
store would hold, shared fairly (its doc): no tenant can empty another's
store by volume or by a stream of fresh keys.

A request keeps reading the partition it started with even if that is
dropped meanwhile (it holds a reference); nothing new is added to a dropped
partition, and it is freed when its last request finishes.

A proposer whose running requests keep *writing* to their partition (Token
Recycling's matrices) pins it instead (``acquire`` ... ``unpin``): a pinned
partition is never dropped, so the partitions alive, held by the map or by a
running request, never exceed ``max_partitions``; when every slot is pinned,
``acquire`` of a new key gives None and makes nothing. ``get`` never pins (the
global store's requests only read their store), and with no pins every
method behaves as it did before pins existed.
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
        # key -> how many holders pinned it (absent: not pinned)
        self._pins: dict[Hashable, int] = {}
        self.dropped = 0

    def get(self, key: Hashable, create: bool = True) -> T | None:
        part = self._parts.get(key)
        if part is not None:
            self._parts.move_to_end(key)
            return part
        if not create:
            return None
        part = self._parts[key] = self.factory()
        # (with every other partition pinned nothing can go: the map is over
        # its bound until a pin is released; only pinning callers get there)
        while len(self._parts) > self.max_partitions and self.drop_oldest(keep=key):
            pass
        return part

    def acquire(self, key: Hashable, pin: bool = True) -> T | None:
        """The partition of ``key`` (made if missing), pinned when ``pin``:
        the caller then calls ``unpin(key)`` once done with it. None, making
        nothing, when ``key`` has no partition and all ``max_partitions`` are
        pinned. Room is made before the new partition exists, so there are
        never more than ``max_partitions``."""
        part = self._parts.get(key)
        if part is not None:
            self._parts.move_to_end(key)
        else:
            while len(self._parts) >= self.max_partitions:
                if not self.drop_oldest():
                    return None
            part = self._parts[key] = self.factory()
        if pin:
            self._pins[key] = self._pins.get(key, 0) + 1
        return part

    def unpin(self, key: Hashable) -> None:
        """Release one pin of ``key`` (taken by ``acquire``); the partition
        stays, droppable again once no pin is left."""
        n = self._pins.get(key, 0)
        if n > 1:
            self._pins[key] = n - 1
        else:
            self._pins.pop(key, None)

    def pinned(self, key: Hashable) -> bool:
        return key in self._pins

    @property
    def num_pinned(self) -> int:
        """Partitions with at least one pin."""
        return len(self._pins)

    def peek(self, key: Hashable) -> T | None:
        """The partition of ``key`` without touching the order (None: none)."""
        return self._parts.get(key)

    def drop_oldest(self, keep: Hashable = None) -> bool:
        """Drop the least recently used partition other than ``keep`` and the
        pinned ones; False when there is none."""
        for key in self._parts:
            if key != keep and key not in self._pins:
                del self._parts[key]
                self.dropped += 1
                return True
        return False

    def clear(self) -> None:
        """Drop every partition (pins too: their holders' ``unpin`` is then a
        no-op)."""
        self._parts.clear()
        self._pins.clear()

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
    store (``max_nbytes``) in all; each store alone may hold ``max_tokens``.

    Who gives way when the budget is reached (issue 45: under plain LRU, 7,000
    tokens from one tenant, or sixteen one-token outputs under fresh salts,
    emptied another tenant's store):

    * tokens: before a document goes in, while the total would pass
      ``max_tokens``, the store holding the most tokens (the least recently
      used among equals) drops its oldest segment; a store left empty is
      dropped. The total can pass the budget only if the largest store holds
      more than its fair share (``max_tokens`` / number of stores), so a
      tenant within its fair share loses nothing while another is above it:
      a heavy tenant sheds its own oldest text first;
    * tenants: a new tenant past ``max_partitions`` replaces the store that
      holds the fewest tokens (the least recently used among equals), not
      the least recently used one: fresh keys with little text displace each
      other, never a store that holds more than they do;
    * bytes: every segment costs a hash table sized for a full segment
      (most of a small store's bytes), so many small stores can pass
      ``max_nbytes`` with few tokens. While they do, the store with the most
      bytes among those with more than one segment drops its oldest; once
      every store is down to one segment, the store with the fewest tokens
      (other than the one just written) is dropped whole.

    The document just added always stays. An idle tenant keeps its store
    until others' text outweighs it (the price of not evicting by recency)."""

    def __init__(self, max_tokens: int, max_partitions: int) -> None:
        from .global_store import GlobalStore

        self.max_tokens = int(max_tokens)
        super().__init__(lambda: GlobalStore(self.max_tokens), max_partitions)
        # what one full store can hold (the stores are made when a document
        # arrives; the untouched pages of a fresh segment cost nothing)
        template = GlobalStore(self.max_tokens)
        self.max_nbytes = template.max_nbytes()
        self.segment_tokens = template.segment_tokens
        self.segments_trimmed = 0   # segments dropped to share the budget

    def get(self, key: Hashable, create: bool = True):
        """``Partitions.get``; a new key past ``max_partitions`` first drops
        the store holding the fewest tokens (class doc)."""
        if create and key not in self._parts:
            while len(self._parts) >= self.max_partitions and self._drop_smallest(keep=key):
                pass
        return super().get(key, create)

    def add(self, key: Hashable, tokens) -> None:
        """Add a document to ``key``'s store within the shared budget (class doc)."""
        n = min(len(tokens), self.segment_tokens)   # what the store keeps of it
        if n == 0:
            return
        while self.num_tokens + n > self.max_tokens and self._trim_largest():
            pass
        self.get(key).add(tokens)
        while self.resident_nbytes() > self.max_nbytes:
            multi = [k for k, s in self._parts.items() if len(s.segments) > 1]
            if multi:
                self._trim(max(multi, key=lambda k: self._parts[k].resident_nbytes()))
            elif not self._drop_smallest(keep=key):
                break

    def _trim(self, key: Hashable) -> None:
        """Drop ``key``'s oldest segment; its store too once empty."""
        store = self._parts[key]
        store.drop_oldest_segment()
        self.segments_trimmed += 1
        if not store.segments:
            del self._parts[key]
            self.dropped += 1

    def _trim_largest(self) -> bool:
        """Trim the store holding the most tokens (the least recently used
        among equals); False when no store holds any."""
        key = max(self._parts, key=lambda k: self._parts[k].num_tokens, default=None)
        if key is None or self._parts[key].num_tokens == 0:
            return False
        self._trim(key)
        return True

    def _drop_smallest(self, keep: Hashable) -> bool:
        """Drop whole the store other than ``keep`` holding the fewest tokens
        (the least recently used among equals); False when there is none."""
        others = [k for k in self._parts if k != keep]
        if not others:
            return False
        del self._parts[min(others, key=lambda k: self._parts[k].num_tokens)]
        self.dropped += 1
        return True

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
