"""What CUDA's caching allocator reserves for a sequence of allocations and frees: the
memory a GPU run holds (torch.cuda.max_memory_reserved, what torchtitan reports), where
the fake step's tracker counts what is allocated. Torch-free.

The rules are CUDACachingAllocator.cpp's (pytorch/pytorch, c10/cuda; as its comments
and constants state them, with the default settings: no max_split_size, no expandable
segments, no garbage-collection threshold):

- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests of at most 1 MiB (kSmallSize) come from the small pool, whose segments are
  2 MiB (kSmallBuffer); larger ones from the large pool, whose segments are 20 MiB
  (kLargeBuffer) for requests under 10 MiB (kMinLargeAlloc), else the request rounded
  up to 2 MiB (kRoundLarge);
- a request takes the smallest free block of its pool that holds it (best fit, then
  the lowest address); with none, a new segment is reserved (cudaMalloc);
- a block larger than the request is split, the rest staying free, where the rest is
  at least 512 bytes (small pool) or more than 1 MiB (large pool);
- a freed block merges with the free blocks beside it in its segment; segments are
  kept (reserved) until empty_cache, which a training step does not call.

Not modelled: streams (a block freed on one stream and NCCL's record_stream delay its
reuse), the allocator's behaviour near the device's limit (freeing cached segments and
retrying), and fragmentation across steps (one step is replayed, from the state the
tracker starts in).
"""

from __future__ import annotations

import bisect
import dataclasses
import math

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def rounded(nbytes: int) -> int:
    """A request's size as the allocator serves it."""
    return max(MIN_BLOCK, math.ceil(nbytes / MIN_BLOCK) * MIN_BLOCK)


def segment_bytes(size: int) -> int:
    """The segment reserved for a (rounded) request that no free block holds."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return math.ceil(size / ROUND_LARGE) * ROUND_LARGE


@dataclasses.dataclass(eq=False)  # a block is itself: found by identity in its segment
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True


class Caching:
    """The allocator's state: `malloc(key, nbytes)` and `free(key)` in the program's
    order; `reserved`, `allocated` and their peaks."""

    def __init__(self) -> None:
        self._pools: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._segments: list[list[_Block]] = []  # each segment's blocks, by offset
        self._small: list[bool] = []  # whether a segment is the small pool's
        self._live: dict[object, _Block] = {}
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0

    def malloc(self, key: object, nbytes: int) -> None:
        if nbytes <= 0:
            return
        if key in self._live:  # a storage resized in place: freed and taken again
            self.free(key)
        size = rounded(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i < len(pool):
            _, seg, offset = pool.pop(i)
            block = next(b for b in self._segments[seg] if b.offset == offset)
        else:  # a new segment
            seg = len(self._segments)
            block = _Block(seg, 0, segment_bytes(size))
            self._segments.append([block])
            self._small.append(small)
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(seg, block.offset + size, rest)
            blocks = self._segments[seg]
            blocks.insert(blocks.index(block) + 1, tail)
            bisect.insort(pool, (tail.size, seg, tail.offset))
            block.size = size
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: object) -> None:
        block = self._live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        blocks, pool = self._segments[block.segment], self._pools[self._small[block.segment]]
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free:  # merge with the next block
            after = blocks.pop(i + 1)
            pool.remove((after.size, after.segment, after.offset))
            block.size += after.size
        if i > 0 and blocks[i - 1].free:  # and with the one before
            before = blocks[i - 1]
            pool.remove((before.size, before.segment, before.offset))
            before.size += block.size
            blocks.pop(i)
            block = before
        bisect.insort(pool, (block.size, block.segment, block.offset))


def replay(events: list[tuple[str, object, int]]) -> Caching:
    """The allocator after `events`: ("malloc", key, bytes) and ("free", key, 0)."""
    alloc = Caching()
    for kind, key, nbytes in events:
        if kind == "malloc":
            alloc.malloc(key, nbytes)
        else:
            alloc.free(key)
    return alloc
