"""Stock mmap's page cache of a model's routed experts, the reference beside the RAM tier's
model (moecache.offline.replay, model "page-cache"): what the kernel keeps of the file when
llama.cpp maps it and the CPU reads the selected experts through the mapping.

The file (ExpertLayout): per MoE layer in order, its gate, up and down expert tensors back to
back, each [n_embd x n_ff x n_expert] with one expert's slice contiguous; a trace gives each
expert's bytes over the three, taken as a third each (the down tensor the remainder; equal for
a model quantized alike, as the synthetic ones are). The tensors that are not routed experts are
not modelled: they are read every token and stay the most recently used pages.

Each observation (a ubatch: the step callback's (n_layers, n) ids) reads, layer by layer, the
gate, then the up, then the down slice of each selected expert once, in ascending expert id
(ggml's mul_mat_id loops over the experts), each slice's 4 KiB pages in order (one thread: the
CPU's threads, each starting on its own rows of a slice, are not modelled; a read-around window
larger than the slice covers them all).

The page cache (PageCache): the file's pages in at most `budget` bytes (the memory the experts
may use), dropped by one of two reclaim policies (PAGE_POLICIES): "lru", one list, least
recently used first, and "two-list", the kernel's active and inactive lists (TwoListPageCache).
The readahead is the kernel's for a mapping (mm/filemap.c, filemap_fault):
- a fault on a page not in the cache (do_sync_mmap_readahead) reads around it: ra_pages pages
  from the faulting page less ra_pages / 2, and marks the page ra_pages / 4 before the window's
  end (PG_readahead) when that page is one it read;
- touching a marked page (do_async_mmap_readahead, page_cache_async_ra) clears the mark and reads
  ra_pages pages from the first page after it not in the cache (within ra_pages), marking that
  first page: a sequential reader streams on;
- ra_pages is the device's read_ahead_kb doubled: llama.cpp calls posix_fadvise(SEQUENTIAL) on
  the file it maps (llama-mmap.cpp), which sets the file's window to twice the device's.
  read_ahead_kb 0 reads the faulting page alone.
- a window holds at most half the budget: the window the CPU reads and the one read ahead of it
  are in memory together, and a window the memory cannot hold is cut where it ends (the kernel
  allocates readahead pages with __GFP_NORETRY and stops at the first it cannot get, and pages
  under read are locked, unreclaimable). Uncut, a window larger than the budget dropped the pages
  its own fault was about to read, so that every page faulted and read the window again: hours
  of replay for a read_ahead_kb above the budget, seconds below it.
ASSUMED: the kernel's mmap_miss counter never turns read-around off (it does after 100 more
faults than page-cache hits; a window of many pages that later accesses find keeps it low),
fault-around (which maps pages already cached) changes no counts here, and pages are 4 KiB
(large folios, reclaimed whole, are not modelled). Counters, comparable with
the engine's: hits and misses count lookups (a token's selection of an expert; a ubatch reads
each selected expert once), a miss when one of the expert's pages faulted; faults the synchronous reads (a thread waits for each), uploads the pages read into the
cache (upload_bytes their bytes, sync and readahead alike), lookup_bytes the experts' bytes the
CPU read.
"""

from __future__ import annotations

import math

import numpy as np

PAGE = 4096
PARTS = 3  # gate, up, down
PAGE_TABLE_BYTES = 13  # the tables' bytes per page of the file: a stamp, a mark and the two lists' four flags


class ExpertLayout:
    """The routed experts' byte ranges in the model file (module docstring)."""

    def __init__(self, expert_bytes, n_expert: int):
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.n_expert = n_expert
        self.part_start = np.zeros((len(self.expert_bytes), PARTS), dtype=np.int64)  # a tensor's offset
        self.part_bytes = np.zeros((len(self.expert_bytes), PARTS), dtype=np.int64)  # one expert's slice
        offset = 0
        for layer, size in enumerate(self.expert_bytes):
            third = size // PARTS
            for part, nbytes in enumerate((third, third, size - 2 * third)):
                self.part_start[layer, part], self.part_bytes[layer, part] = offset, nbytes
                offset += nbytes * n_expert
        self.file_bytes = offset

    def pages(self, layer: int, part: int, expert: int) -> tuple[int, int]:
        """[first, end) pages of one expert's slice of one tensor."""
        start = int(self.part_start[layer, part] + expert * self.part_bytes[layer, part])
        return start // PAGE, -(-(start + int(self.part_bytes[layer, part])) // PAGE)


class _Log:
    """Pages in the order they entered a list, with the stamp each entered with; an entry is
    stale once its page's stamp or list changed. The oldest live entries come off the front."""

    def __init__(self):
        self.pages = np.zeros(1 << 16, dtype=np.int64)
        self.stamps = np.zeros(1 << 16, dtype=np.int64)
        self.head = self.end = 0

    def append(self, pages, stamps) -> None:
        n = pages.size
        if self.end + n > self.pages.size:
            live = self.end - self.head
            size = self.pages.size
            while live + n > size // 2:
                size *= 2
            for name in ("pages", "stamps"):
                grown = np.zeros(size, dtype=np.int64)
                grown[:live] = getattr(self, name)[self.head:self.end]
                setattr(self, name, grown)
            self.head, self.end = 0, live
        self.pages[self.end:self.end + n], self.stamps[self.end:self.end + n] = pages, stamps
        self.end += n

    def take(self, n: int, live) -> tuple[np.ndarray, np.ndarray]:
        """The n oldest live entries (fewer when the log holds fewer; live(pages, stamps): a mask)
        taken off: their pages and their positions, for give_back."""
        pages, positions = [], []
        window = 2 * n + 64  # grows while stale entries fill it
        while n > 0 and self.head < self.end:
            stop = min(self.end, self.head + window)
            window *= 2
            found = self.head + np.flatnonzero(live(self.pages[self.head:stop], self.stamps[self.head:stop]))[:n]
            self.head = int(found[-1]) + 1 if found.size == n else stop
            pages.append(self.pages[found])
            positions.append(found)
            n -= found.size
        if not pages:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        return np.concatenate(pages), np.concatenate(positions)

    def give_back(self, position: int) -> None:
        """Entries from `position` on were not used after all (before any append)."""
        self.head = min(self.head, position)


class PageCache:
    """The model file's 4 KiB pages in memory, read through a mapping with the kernel's
    readahead (module docstring); a model under the replay's one driver: step(ids) per
    observation, totals() its counters. Subclasses are the reclaim policies (PAGE_POLICIES)."""

    name = "?"

    def __init__(self, layout: ExpertLayout, budget_bytes: int, read_ahead_kb: int):
        if budget_bytes < PAGE:
            raise ValueError(f"the page cache's budget must hold a page ({PAGE} bytes), got {budget_bytes}")
        if read_ahead_kb < 0:
            raise ValueError(f"read_ahead_kb must be >= 0, got {read_ahead_kb}")
        self.layout = layout
        self.n_pages = -(-layout.file_bytes // PAGE)
        self.capacity = budget_bytes // PAGE
        # llama.cpp's POSIX_FADV_SEQUENTIAL doubles it; two windows fit the budget (module docstring)
        self.ra_pages = min(2 * read_ahead_kb * 1024 // PAGE, self.capacity // 2)
        self._stamp = np.zeros(self.n_pages, dtype=np.int64)  # when a cached page last entered a list; 0: out
        self._marked = np.zeros(self.n_pages, dtype=bool)
        self._clock = 1
        self.cached = 0
        self.counters = dict.fromkeys(("hits", "misses", "uploads", "upload_bytes", "faults", "lookup_bytes",
                                       "evictions"), 0)

    def totals(self) -> dict:
        return dict(self.counters)

    def cached_pages(self) -> np.ndarray:
        """The pages in the cache, ascending."""
        return np.flatnonzero(self._stamp)

    def marked_pages(self) -> np.ndarray:
        """The pages carrying a readahead mark (PG_readahead), ascending."""
        return np.flatnonzero(self._marked)

    def step(self, ids) -> np.ndarray:
        """One ubatch: (n_layers, n) selected expert ids (-1: none), read layer by layer; returns
        how many experts each layer read."""
        ids = np.asarray(ids)
        layout, count = self.layout, self.counters
        read = np.zeros(len(ids), dtype=np.int64)
        for layer, row in enumerate(ids):
            experts, uses = np.unique(row[row >= 0], return_counts=True)
            read[layer] = experts.size
            count["lookup_bytes"] += experts.size * layout.expert_bytes[layer]
            faulted = np.zeros(experts.size, dtype=bool)
            for part in range(PARTS):
                for i, expert in enumerate(experts.tolist()):
                    faulted[i] |= self._read_range(*layout.pages(layer, part, expert))
            count["misses"] += int(uses[faulted].sum())
            count["hits"] += int(uses[~faulted].sum())
        return read

    def _read_range(self, first: int, end: int) -> bool:
        """The CPU reads pages [first, end) in order; returns whether one of them faulted."""
        faulted = False
        while first < end:
            present = self._stamp[first:end] != 0
            events = np.flatnonzero(~present | self._marked[first:end])
            if not events.size:
                self._touch(first, end)
                return faulted
            page = first + int(events[0])
            self._touch(first, page)
            if present[page - first]:  # a readahead mark: stream on
                self._marked[page] = False
                self._touch(page, page + 1)
                self._async_readahead(page)
            else:
                faulted = True
                self.counters["faults"] += 1
                self._read_around(page)
            first = page + 1
        return faulted

    def _read_around(self, page: int) -> None:
        """do_sync_mmap_readahead: the window around a faulting page, which the CPU then reads."""
        if not self.ra_pages:
            self._read(page, page + 1, touched=page)
            return
        start = max(0, page - self.ra_pages // 2)
        self._read(start, min(self.n_pages, start + self.ra_pages),
                   mark=start + self.ra_pages - self.ra_pages // 4, touched=page)

    def _async_readahead(self, page: int) -> None:
        """page_cache_async_ra: the next window, from the first page after `page` not cached."""
        stop = min(self.n_pages, page + 1 + self.ra_pages)
        missing = np.flatnonzero(self._stamp[page + 1:stop] == 0)
        if missing.size:
            start = page + 1 + int(missing[0])
            self._read(start, min(self.n_pages, start + self.ra_pages), mark=start)

    def _read(self, start: int, stop: int, mark: int | None = None, touched: int | None = None) -> None:
        """Read the pages of [start, stop) not in the cache (one request), marking `mark` when
        it is one of them; `touched`, the faulting page, is used at once."""
        new = start + np.flatnonzero(self._stamp[start:stop] == 0)
        if not new.size:
            return
        self.counters["uploads"] += new.size
        self.counters["upload_bytes"] += new.size * PAGE
        self._insert(new)
        self.cached += new.size
        if mark is not None and start <= mark < stop and self._stamp[mark] >= self._clock - new.size:
            self._marked[mark] = True
        if touched is not None:
            self._touch(touched, touched + 1)
        if self.cached > self.capacity:
            self._evict(self._reclaim(self.cached - self.capacity))

    def _stamped(self, pages) -> np.ndarray:
        """New stamps for these pages, in this order."""
        stamps = np.arange(self._clock, self._clock + pages.size)
        self._stamp[pages] = stamps
        self._clock += pages.size
        return stamps

    def _evict(self, victims) -> None:
        self._stamp[victims] = 0
        self._marked[victims] = False
        self.cached -= victims.size
        self.counters["evictions"] += victims.size

    # the reclaim policy
    def _insert(self, pages) -> None:
        """Pages just read enter the cache."""
        raise NotImplementedError

    def _touch(self, first: int, end: int) -> None:
        """The CPU read the cached pages [first, end)."""
        raise NotImplementedError

    def _reclaim(self, n: int) -> np.ndarray:
        """The n pages to drop."""
        raise NotImplementedError


class LruPageCache(PageCache):
    """One list, least recently used first: a page read or touched becomes the newest."""

    name = "lru"

    def __init__(self, *args):
        super().__init__(*args)
        self._log = _Log()

    def _insert(self, pages):
        self._log.append(pages, self._stamped(pages))

    def _touch(self, first, end):
        if end > first:
            self._insert(np.arange(first, end, dtype=np.int64))

    def _reclaim(self, n):
        victims, _ = self._log.take(n, lambda p, s: self._stamp[p] == s)
        if victims.size < n:
            raise AssertionError(f"the page cache counts {n} pages more than its list holds")
        return victims


class TwoListPageCache(PageCache):
    """The kernel's two lists (mm/vmscan.c, without the multi-generational LRU): a page read
    enters the inactive list; the CPU's reads set its accessed bit and move nothing. Reclaim
    takes the inactive list's oldest page: not accessed since its last scan, it is dropped;
    accessed, it goes back to the inactive list's new end, and is activated when it was
    accessed at the scan before too (folio_check_references: a mapped page needs two
    references). The active list is scanned too, in proportion to the lists' sizes
    (get_scan_count), when the file refaulted since the last reclaim (a page read again after
    its eviction) or the inactive list is low (inactive x ratio < active, ratio int_sqrt(10 x
    the lists' GiB), 1 under 1 GiB; shrink_lruvec's may_deactivate): its oldest pages go back
    to the inactive list's new end, their accessed bits cleared (shrink_active_list). Not
    modelled: the refault distance that activates a page read again soon after its eviction
    (mm/workingset.c), large folios."""

    name = "two-list"
    INACTIVE, ACTIVE = 1, 2

    def __init__(self, *args):
        super().__init__(*args)
        self._list = np.zeros(self.n_pages, dtype=np.int8)
        self._accessed = np.zeros(self.n_pages, dtype=bool)    # the page table's young bit
        self._referenced = np.zeros(self.n_pages, dtype=bool)  # PG_referenced
        self._evicted = np.zeros(self.n_pages, dtype=bool)     # a shadow entry: its read is a refault
        self._refaulted = False
        self._logs = {self.INACTIVE: _Log(), self.ACTIVE: _Log()}
        self._sizes = {self.INACTIVE: 0, self.ACTIVE: 0}
        gib = self.capacity * PAGE >> 30
        self._ratio = math.isqrt(10 * gib) if gib else 1

    def active_pages(self) -> np.ndarray:
        """The pages on the active list, ascending."""
        return np.flatnonzero(self._list == self.ACTIVE)

    def referenced_pages(self) -> np.ndarray:
        """The pages whose PG_referenced is set, ascending."""
        return np.flatnonzero(self._referenced)

    def _move(self, pages, source, to) -> None:
        """Pages of one list (source; 0: new) onto a list's new end."""
        if source:
            self._sizes[source] -= pages.size
        self._list[pages] = to
        self._sizes[to] += pages.size
        self._logs[to].append(pages, self._stamped(pages))

    def _insert(self, pages):
        self._refaulted |= bool(self._evicted[pages].any())
        self._evicted[pages] = self._accessed[pages] = self._referenced[pages] = False
        self._move(pages, 0, self.INACTIVE)

    def _touch(self, first, end):
        self._accessed[first:end] = True

    def _live(self, where):
        return lambda p, s: (self._stamp[p] == s) & (self._list[p] == where)

    def _deactivate(self, n: int) -> None:
        pages, _ = self._logs[self.ACTIVE].take(n, self._live(self.ACTIVE))
        self._accessed[pages] = False
        self._move(pages, self.ACTIVE, self.INACTIVE)

    def _reclaim(self, n):
        active, inactive = self._sizes[self.ACTIVE], self._sizes[self.INACTIVE]
        if self._refaulted or inactive * self._ratio < active:
            self._refaulted = False
            self._deactivate(-(-n * active // max(inactive, 1)))
        victims = []
        while n > 0:
            if not self._sizes[self.INACTIVE]:
                self._deactivate(n)
            log = self._logs[self.INACTIVE]
            pages, positions = log.take(4 * n + 64, self._live(self.INACTIVE))  # some will be kept
            if not pages.size:
                raise AssertionError(f"the page cache counts {n} pages more than its lists hold")
            drop = ~self._accessed[pages]
            if int(drop.sum()) >= n:  # the scan stops at the n-th page dropped
                cut = int(np.flatnonzero(drop)[n - 1]) + 1
                if cut < pages.size:
                    log.give_back(int(positions[cut]))
                pages, drop = pages[:cut], drop[:cut]
            kept = pages[~drop]
            activate = kept[self._referenced[kept]]
            rotate = kept[~self._referenced[kept]]
            self._accessed[kept] = False
            self._referenced[rotate] = True
            self._move(rotate, self.INACTIVE, self.INACTIVE)
            self._move(activate, self.INACTIVE, self.ACTIVE)
            gone = pages[drop]
            self._list[gone] = 0
            self._sizes[self.INACTIVE] -= gone.size
            self._referenced[gone] = False
            self._evicted[gone] = True
            victims.append(gone)
            n -= gone.size
        return np.concatenate(victims)


PAGE_POLICIES = {cls.name: cls for cls in (LruPageCache, TwoListPageCache)}
