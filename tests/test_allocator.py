"""The caching allocator's model (predict/allocator.py) on sequences whose reserved
bytes follow from CUDACachingAllocator.cpp's rules by hand."""

from __future__ import annotations

from parabench.predict.allocator import LARGE_BUFFER, SMALL_BUFFER, Caching, replay

MiB = 2**20


def test_requests_are_rounded_and_served_from_their_pools_segments():
    """A 100-byte request takes 512 bytes of a 2 MiB small segment; a 3 MiB one, a 20 MiB
    large segment; a 50 MiB one, its own segment of 50 MiB (already 2 MiB whole), and
    51 MiB rounds up to 52."""
    a = Caching()
    a.malloc("tiny", 100)
    assert (a.allocated, a.reserved) == (512, SMALL_BUFFER)
    a.malloc("mid", 3 * MiB)
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER
    a.malloc("big", 50 * MiB)
    a.malloc("odd", 51 * MiB)
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER + 50 * MiB + 52 * MiB
    # the 20 MiB segment's rest (17 MiB) serves a later 3 MiB request: nothing new
    a.malloc("mid2", 3 * MiB)
    assert a.reserved == SMALL_BUFFER + LARGE_BUFFER + 102 * MiB


def test_freed_blocks_are_reused_merged_and_never_given_back():
    """Two 8 MiB blocks freed side by side merge into one free 16 MiB (with the 4 MiB
    rest of their 20 MiB segment, 20 MiB whole), which a 12 MiB request can use (it is
    at least 10 MiB, so a segment of its own would be 12 MiB: it takes the free block
    instead). A request larger than any free block reserves a new segment; freeing
    everything leaves every segment reserved."""
    a = replay([("malloc", "x", 8 * MiB), ("malloc", "y", 8 * MiB), ("free", "x", 0)])
    assert a.reserved == LARGE_BUFFER and a.allocated == 8 * MiB
    a.free("y")
    a.malloc("z", 12 * MiB)
    assert a.reserved == LARGE_BUFFER
    a.malloc("w", 30 * MiB)
    assert a.reserved == LARGE_BUFFER + 30 * MiB
    for k in ("z", "w"):
        a.free(k)
    assert a.allocated == 0 and a.reserved == a.peak_reserved == LARGE_BUFFER + 30 * MiB
    assert a.peak_allocated == 42 * MiB


def test_a_large_blocks_rest_of_a_mebibyte_or_less_is_not_split_off():
    """A 12 MiB free block serving an 11.5 MiB request keeps its 0.5 MiB rest (the large
    pool splits only a rest over 1 MiB): 12 MiB allocated, as the allocator counts it."""
    a = replay([("malloc", "a", 12 * MiB), ("free", "a", 0), ("malloc", "b", 23 * MiB // 2)])
    assert a.allocated == 12 * MiB and a.reserved == 12 * MiB
