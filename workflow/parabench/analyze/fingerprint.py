"""A cell's parameters as the equivalence check needs them (params.pt): whole where the
model is small, else a fingerprint of a few MiB from which the same figures are estimated.

Whole, the parameters are a cell's largest file by far: config/gpu.yaml's resmlp has
541M of them, 2.2 GB a cell, 270 GB over its sweep, and the merge would read every one.
So a cell keeps (`of`, on rank 0, from the whole parameters `full_state` gathered):

- **exact**, a model of at most EXACT_MAX = 2^22 elements (16 MiB in fp32; every model
  of the default CPU run): the parameters themselves, a state dict as torch.save writes
  it, as every cell did before schema version 5. max |a − b| and ‖a − b‖₂ are exact.
- **sketch**, a larger model: a count sketch of the whole parameter vector (BUCKETS =
  2^16 float64 sums) and a fixed sample of SAMPLE = 2^20 of its elements (their own
  dtype): 4.5 MiB for an fp32 model of any size.

The count sketch (Charikar, Chen and Farach-Colton, 2002) adds each element, times a
sign s(i) = ±1, into a bucket h(i): S(x)[j] = Σ_{h(i)=j} s(i)·x_i. It is linear, so
S(a) − S(b) = S(a − b), and for any difference d, with h and s drawn from a 4-wise
independent family, E‖S(d)‖² = ‖d‖² and Var ‖S(d)‖² = (2/k)·Σ_{i≠j} d_i²·d_j² ≤
(2/k)·‖d‖⁴ (Thorup and Zhang, 2012). At k = 2^16 buckets the relative error of ‖S(d)‖²
has a standard deviation of at most √(2/k) = 0.55%, that of ‖S(d)‖ at most 0.28%: at 5
standard deviations the sketched rel_param_diff is within ±1.4% of the exact one. (For
any d, Chebyshev bounds a miss that large by 1/25; for a difference spread over many
elements, as rounding and training leave it, ‖S(d)‖² sums 65,536 near-independent
buckets and is near normal, so 5σ is about one in two million; for a difference in a
few elements it is exact unless two of them share a bucket. tests/test_fingerprint.py
measures the spread over hashes, and the error on differences of each kind.) The
verdict compares rel_param_diff with 25 times the reorder distance, which the reference
measures exactly, in memory (cell.reorder_spread): the sketch can turn a verdict only
where the exact distance lies within 1.4% of the tolerance (24.6-25.4x the reorder
distance), far from where the strategies that do the same maths land (up to 9.2x) and
where half the learning rate lands (148x or more).

max |a − b| over the sample is a lower bound on the true largest difference: a sample
of 2^20 sees a difference confined to a few elements only by chance. Elements are
sampled one per stratum of N / 2^20 consecutive elements, at a hashed place in it, so
every tensor is sampled in proportion to its size, and no stride aliases a row width.

The hash: tensors in name order, each flattened and cut into chunks of CHUNK = 2^20
elements; chunk c has its own polynomial g_c(x) = (a₃x³ + a₂x² + a₁x + a₀) mod p, p =
2^31 − 1, x the element's index in the chunk, its coefficients drawn from SEED and c
by splitmix64: a 4-wise independent value in [0, p) whose low 16 bits are the bucket
and bit 16 the sign (uniform to within 2^-14, p being odd and near 2^31). Integer
arithmetic below 2^63 throughout (a value below 2^32 times x below 2^20), so every
device and torch computes the same hash; chunks, whose hashes are drawn independently,
bound the temporaries. The sums are float64.

Torch-free until a fingerprint is made or read: doctor and the report read the sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from parabench.analyze import equivalence
from parabench.records import ResultsError

if TYPE_CHECKING:
    import torch

EXACT_MAX = 2**22  # elements kept whole
BUCKETS = 2**16
SAMPLE = 2**20
CHUNK = 2**20  # elements hashed at a time, each chunk with a hash of its own
SEED = 0x5EED_F1A6
FORMAT = 1  # of the sketch's file; an exact one is a state dict
_P = 2**31 - 1  # a Mersenne prime: x mod p without a division
_MASK = 2**64 - 1
# how far the sketched rel_param_diff may be from the exact one, at 5 standard
# deviations of its relative error (the module's docstring derives it)
SKETCH_ERROR = 5 * math.sqrt(2 / BUCKETS) / 2


def _splitmix64(n: int) -> int:
    """The n-th output of splitmix64 from SEED (Steele, Lea and Flood, 2014)."""
    z = (SEED + n * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _coefficients(stream: int) -> list[int]:
    """The four coefficients of hash `stream` (a chunk's number; -1: the sample's)."""
    return [_splitmix64(4 * (stream + 1) + i) % _P for i in range(4)]


def _mod_p(h: torch.Tensor) -> torch.Tensor:
    """h mod p up to one p, for int64 h below 2^62: a value below 2^32 (h overwritten)."""
    high = h >> 31
    return high.add_(h.bitwise_and_(_P))


def polynomial_hash(x: torch.Tensor, stream: int) -> torch.Tensor:
    """g(x) in [0, p] (p itself is 0, once in p) for int64 `x` in [0, 2^20]: the
    4-wise independent hash of `stream`, by Horner's rule (each product below 2^52)."""
    a0, a1, a2, a3 = _coefficients(stream)
    h = _mod_p((x * a3).add_(a2))
    h = _mod_p(h.mul_(x).add_(a1))
    h = _mod_p(h.mul_(x).add_(a0))
    return _mod_p(h)


def stored_bytes(n_params: int, element_bytes: int = 4) -> int:
    """What params.pt holds for a model of `n_params` elements of `element_bytes`,
    without the file's own few KB (the names, torch.save's archive)."""
    if n_params <= EXACT_MAX:
        return n_params * element_bytes
    return BUCKETS * 8 + SAMPLE * element_bytes


def of(state: Mapping[str, torch.Tensor], device: torch.device | None = None) -> dict:
    """What a cell keeps of its whole parameters: themselves where at most EXACT_MAX
    elements, else their sketch (hashed on `device`)."""
    if sum(t.numel() for t in state.values()) <= EXACT_MAX:
        return dict(state)
    return sketch(state, device)


def sketch(state: Mapping[str, torch.Tensor], device: torch.device | None = None) -> dict:
    """The count sketch and the sample of `state` (the module's docstring), hashed
    and summed on `device` (each tensor's own where None), a chunk at a time: a
    cell's whole parameters are on the CPU (full_state), whose cores took 87 s for
    541M of them on a 2-core VM, so a CUDA cell hashes on its GPU (a few tens of MB
    of temporaries). A GPU adds into the buckets in no fixed order (atomic adds): two
    sketches of the same parameters may then differ in their last bits, 1e-16 of the
    norm, far below any tolerance."""
    import torch

    names = sorted(state)
    total = sum(state[n].numel() for n in names)
    if total < SAMPLE:
        raise ValueError(f"{total} elements: fewer than the {SAMPLE} sampled (keep them whole)")
    sums = torch.zeros(BUCKETS, dtype=torch.float64)
    # the sample: one element per stratum of `stride` (a tail shorter than one is not)
    stride = total // SAMPLE
    j = torch.arange(SAMPLE, dtype=torch.int64)
    where = j * stride + polynomial_hash(j, -1) % stride
    picked, start, stream = [], 0, 0
    for name in names:
        flat = state[name].detach().reshape(-1)
        on = flat.device if device is None else device
        index = torch.arange(min(CHUNK, flat.numel()), dtype=torch.int64, device=on)
        part = torch.zeros(BUCKETS, dtype=torch.float64, device=on)
        for lo in range(0, flat.numel(), CHUNK):
            values = flat[lo : lo + CHUNK].to(on)
            g = polynomial_hash(index[: values.numel()], stream)
            signed = values.double().mul_(1 - ((g >> 15) & 2))  # bit 16: 1 - 2 * bit
            part.index_add_(0, g.bitwise_and_(BUCKETS - 1), signed)
            stream += 1
        sums += part.cpu()
        first, last = torch.searchsorted(where, torch.tensor([start, start + flat.numel()]))
        picked.append(flat[(where[first:last] - start).to(flat.device)].cpu())
        start += flat.numel()
    return {
        "fingerprint": FORMAT,
        "names": names,
        "shapes": [list(state[n].shape) for n in names],
        "seed": SEED,
        "chunk": CHUNK,
        "sketch": sums,
        "sample": torch.cat(picked),
    }


def encode(state: Mapping[str, torch.Tensor], device: torch.device | None = None) -> bytes:
    """params.pt's bytes for `state`: `of(state, device)` as torch.save writes it."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(of(state, device), buf)
    return buf.getvalue()


_SKETCH_KEYS = {"names", "shapes", "seed", "chunk", "sketch", "sample"}


def is_sketch(found: dict) -> bool:
    return isinstance(found.get("fingerprint"), int)  # a state dict holds tensors only


def load(path: Path) -> dict:
    """A cell's params.pt: its state dict or its sketch. Mapped, not read: a state
    dict of more than EXACT_MAX elements (a cell of schema version 4 or earlier kept
    every model whole) is refused without reading its data, which a merge of a GPU
    sweep could not hold."""
    import torch

    try:
        found = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch's own words: a truncated archive, a pickled object
        raise ResultsError(f"{path}: unreadable parameters ({e})") from e
    if not isinstance(found, dict):
        raise ResultsError(f"{path}: not a parameter file")
    if is_sketch(found):
        if found["fingerprint"] != FORMAT:
            raise ResultsError(
                f"{path}: parameter fingerprint format {found['fingerprint']}, this "
                f"parabench reads {FORMAT}; rerun the cell (delete its directory)"
            )
        if missing := sorted(_SKETCH_KEYS - found.keys()):
            raise ResultsError(f"{path}: parameter fingerprint lacks {missing}")
        return found
    if not all(isinstance(t, torch.Tensor) for t in found.values()):
        raise ResultsError(f"{path}: not a parameter file")
    n = sum(t.numel() for t in found.values())
    if n > EXACT_MAX:
        raise ResultsError(
            f"{path}: holds all {n:,} parameters whole, as cells of schema version 4 and "
            f"earlier kept them; the merge reads a model of more than {EXACT_MAX:,} from "
            "its fingerprint only: rerun the cell (delete its directory)"
        )
    return found


def _layout(found: dict) -> tuple:
    """What two fingerprints must share to be compared: names, shapes, the hash."""
    if is_sketch(found):
        shapes = [tuple(s) for s in found["shapes"]]
        hashed = (found["seed"], found["chunk"], found["sketch"].numel(), found["sample"].numel())
        return found["names"], shapes, hashed
    names = sorted(found)
    return names, [tuple(found[n].shape) for n in names], None


def difference(a: dict, b: dict) -> tuple[float, float]:
    """(max |a − b|, ‖a − b‖₂) of two cells' parameters from what they kept: exact for
    state dicts; for sketches, over the sample and from the sketch (the module's
    docstring bounds its error). ValueError saying what differs where they do not
    describe the same parameters."""
    (names_a, shapes_a, hash_a), (names_b, shapes_b, hash_b) = _layout(a), _layout(b)
    if names_a != names_b:
        raise ValueError("parameter names differ")
    if shapes_a != shapes_b:
        raise ValueError("parameter shapes differ")
    if hash_a != hash_b:
        raise ValueError("parameter fingerprints of different kinds")
    if hash_a is None:
        return equivalence.max_abs_diff(a, b), equivalence.l2_diff(a, b)
    sample = (a["sample"].double() - b["sample"].double()).abs().max().item()
    return sample, (a["sketch"] - b["sketch"]).norm().item()
