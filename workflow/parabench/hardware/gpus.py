"""Accelerator profiles: what `parabench advise` prices a rank's ops at. Torch-free.

A profile is a roofline: each op takes the longer of its FLOPs at the achievable
matmul rate and its bytes at the memory bandwidth, and at least `op_floor_s` (a
kernel's shortest run). Each figure says where it comes from:

- peak: the datasheet's dense BF16 rate (what MFU divides by, as torchtitan does);
- achievable: the Maximum Achievable Matmul FLOPS (MAMF) measured by stas00's
  ml-engineering book ("Maximum Achievable Matmul FLOPS comparison table", compute/
  accelerator/README.md: the best mean over a search of GEMM shapes; "a rough
  estimation"). Real models' GEMMs are smaller than the best shape, so this is an
  upper bound on the rate: predictions err fast. Where the GPU is at hand,
  `calibrated` replaces it with a GEMM measured there;
- attention: fused attention's rate, from the FlashAttention papers: FlashAttention-2
  "achieving only 35% utilization on the H100 GPU" (FlashAttention-3, Shah et al. 2024,
  its abstract; PyTorch's SDPA runs FlashAttention-2 on H100), "50-73% of the
  theoretical maximum FLOPs/s on A100" (FlashAttention-2, Dao 2023: its lower end);
- fp8: the achievable FP8 GEMM rate, what advise prices Float8 linears at (see _FP8);
  none on an A100, which has no FP8 tensor cores;
- bandwidth: the datasheet's. No authoritative achievable fraction was found, so
  memory-bound ops are priced at the peak: another reason predictions err fast.

`this-machine` is this host's device, measured when asked for (fakerank.this_machine):
its CPU, or its first GPU where the run's `device` is CUDA. What it cannot measure, a
GPU's datasheet peak and fused attention's rate, it takes from `DEVICES`, matched by
the name the device reports. It is what the on-machine ranking check prices the
default run's cells at.

`fits` decides whether a rank's peak fits a device, for plan and advise alike.

A user's own: a YAML or JSON file with the same keys (name, peak_flops,
achievable_flops, memory_bytes, bandwidth, source; op_floor_s, attention_flops and
fp8_flops optional).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

GiB, MiB = 2**30, 2**20


class GPUError(ValueError):
    """A GPU profile that cannot be used, with why."""


@dataclasses.dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float  # dense BF16 FLOP/s, the datasheet's
    achievable_flops: float  # FLOP/s a large GEMM reaches
    memory_bytes: float  # what one device holds
    bandwidth: float  # bytes/s of its memory
    source: str
    attention_flops: float = 0.0  # FLOP/s of fused attention (0: the matmul rate)
    op_floor_s: float = 3e-6  # the shortest a kernel runs (launch and tail)
    cores: int = 0  # CPU profiles: the cores its ranks share (0: a device each)
    fp8_flops: float = 0.0  # FLOP/s a large FP8 GEMM reaches (0: no FP8 tensor cores)
    # CPU profiles: what each rank's process holds besides its tensors (its interpreter
    # and torch), where all of a layout's ranks share the host's memory
    process_bytes: float = 0.0

    def op_time(
        self, flops: float, nbytes: float, attention: bool = False, fp8: bool = False
    ) -> float:
        """One op's seconds on this device: its roofline bound, at least the floor."""
        if fp8:
            rate = self.fp8_flops
        elif attention:
            rate = self.attention_flops or self.achievable_flops
        else:
            rate = self.achievable_flops
        return max(flops / rate, nbytes / self.bandwidth, self.op_floor_s)


_FA2_H100 = (
    "attention 346 TFLOP/s (FlashAttention-2's 35% of peak on H100, per FlashAttention-3's "
    "abstract)"
)
_MAMF = (
    "MAMF from stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable "
    "Matmul FLOPS comparison table'"
)

# Hopper's dense FP8 rate is twice its BF16 one (1,979 against 989 TFLOP/s: NVIDIA's
# H100 datasheet, halved from its with-sparsity figures). The MAMF table lists FP8 for
# no H100, so the achievable FP8 rate is the BF16 MAMF's share of peak at the FP8 peak:
# 1,589 TFLOP/s. Two measurements of the same silicon run under it: the table's FP8 row
# for GH200 (H100's SMs at 900 W), 1,535 TFLOP/s, 3% under; a published FP8 GEMM of 8,192
# cubed on an H800 SXM, 1,507 TFLOP/s (tile-ai/tilelang,
# benchmark/matmul_fp8/README.md), 5% under.
_FP8 = (
    "FP8 1,589 TFLOP/s (the BF16 MAMF's 80.3% of the 1,979 TFLOP/s dense FP8 peak; "
    "the MAMF table's FP8 on GH200: 1,535; tilelang's FP8 GEMM at 8,192 cubed on H800 "
    "SXM: 1,507)"
)
_H100_SXM = "H100 SXM 80 GB HBM3 at 700 W: 989 TFLOP/s dense BF16, 3.35 TB/s (datasheet)"
_H200_SXM = "H200 SXM 141 GB HBM3e: 989 TFLOP/s dense BF16, 4.8 TB/s (datasheet)"
_A100_SXM_80 = "A100 SXM 80 GB HBM2e: 312 TFLOP/s dense BF16, 2,039 GB/s (datasheet)"
_FA2_A100 = (
    "attention 156 TFLOP/s (FlashAttention-2's paper: 50-73% of peak on A100, its lower end)"
)

# The H100 SXM's MAMF over its peak (794.5 of 989 TFLOP/s), and the middle of the range
# torchtitan's footnote gives its 500 W HBM2e H100's peak: between the NVL's and the SXM's
_H100_MAMF_SHARE = 794.5 / 989
_H100_500W_PEAK = (989e12 + 835.5e12) / 2

PROFILES: dict[str, GPU] = {
    "h100": GPU(
        "h100",
        989e12,
        794.5e12,
        81559 * MiB,
        3.35e12,
        f"{_H100_SXM}, 81,559 MiB (what the device reports); "
        f"achievable 794.5 TFLOP/s ({_MAMF}: 80.3% of peak); {_FA2_H100}; {_FP8}",
        attention_flops=0.35 * 989e12,
        fp8_flops=2 * 794.5e12,
    ),
    "h100-96gb-500w": GPU(
        "h100-96gb-500w",
        989e12,
        _H100_500W_PEAK * _H100_MAMF_SHARE,
        96 * GiB,
        2.4e12,
        "H100 with 96 GB HBM2e at 2.4 TB/s and a 500 W power limit, as in torchtitan's "
        "benchmarks/llama3_h100_202412_torchtitan.md, whose footnote puts its peak "
        "'between SXM and NVL' (989 and 835.5 TFLOP/s dense BF16: NVIDIA's H100 datasheet, "
        "halved from its with-sparsity figures) and unknown within; its MFU divides by the "
        "SXM's. Priced at the middle, 912 TFLOP/s: achievable 733 TFLOP/s, the SXM's MAMF "
        f"share ({_MAMF}: 80.3%); attention and FP8 as on the SXM, at this peak. The range's "
        "ends move a predicted step by about 8% either way (docs/design/advise.md)",
        attention_flops=0.35 * _H100_500W_PEAK,
        fp8_flops=2 * _H100_500W_PEAK * _H100_MAMF_SHARE,
    ),
    "h200": GPU(
        "h200",
        989e12,
        794.5e12,
        143771 * MiB,
        4.8e12,
        f"{_H200_SXM}, 143,771 MiB (what the device reports); achievable 794.5 TFLOP/s "
        f"({_MAMF}, which lists H200 as H100's compute); {_FA2_H100}; {_FP8}",
        attention_flops=0.35 * 989e12,
        fp8_flops=2 * 794.5e12,
    ),
    "a100": GPU(
        "a100",
        312e12,
        271.2e12,
        81920 * MiB,
        2.039e12,
        f"{_A100_SXM_80}, 81,920 MiB (what the device reports); achievable 271.2 TFLOP/s "
        f"({_MAMF}: 86.9% of peak); {_FA2_A100}",
        attention_flops=0.5 * 312e12,
    ),
}

THIS_MACHINE = "this-machine"
NAMES = (*PROFILES, THIS_MACHINE)


@dataclasses.dataclass(frozen=True)
class Datasheet:
    """What this-machine cannot measure on a GPU it knows: the peak MFU divides by, and
    fused attention's rate (its GEMM rate, memory and bandwidth it measures)."""

    peak_flops: float  # dense BF16 FLOP/s, the datasheet's
    attention_flops: float  # FLOP/s of fused attention
    source: str


def _fa2_h100(peak: float) -> str:
    return (
        f"attention {0.35 * peak / 1e12:.0f} TFLOP/s (FlashAttention-2's 35% of peak on H100 "
        "SXM, per FlashAttention-3's abstract, at this variant's peak)"
    )


def _fa2_a100(peak: float) -> str:
    return (
        f"attention {0.5 * peak / 1e12:.0f} TFLOP/s (FlashAttention-2's paper: 50-73% of "
        "peak on A100 SXM, its lower end, at this variant's peak)"
    )


def _profiled(key: str, source: str) -> Datasheet:
    """The device a profile of PROFILES is: its figures, from there."""
    return Datasheet(PROFILES[key].peak_flops, PROFILES[key].attention_flops, source)


_A100 = "NVIDIA A100 Tensor Core GPU datasheet"

# Each GPU by the name it reports (torch.cuda.get_device_name, nvidia-smi's name), matched
# whole: an H100 PCIe or NVL is an H100 with a lower peak than the SXM's, and a MIG slice
# ("... MIG 1g.10gb") is none of them. NVIDIA's datasheets give tensor-core rates with
# 2:4 sparsity from Hopper on: the dense rate is half.
DEVICES: dict[str, Datasheet] = {
    "NVIDIA H100 80GB HBM3": _profiled("h100", f"{_H100_SXM}; {_FA2_H100}"),
    "NVIDIA H100 PCIe": Datasheet(
        756.5e12,
        0.35 * 756.5e12,
        "H100 PCIe 80 GB HBM2e at 300-350 W: 1,513 TFLOP/s BF16 with sparsity, 756.5 dense, "
        f"2 TB/s (NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column); {_fa2_h100(756.5e12)}",
    ),
    "NVIDIA H100 NVL": Datasheet(
        835.5e12,
        0.35 * 835.5e12,
        "H100 NVL 94 GB HBM3 at 350-400 W: 1,671 TFLOP/s BF16 with sparsity, 835.5 dense, "
        f"3.9 TB/s (NVIDIA H100 Tensor Core GPU datasheet, H100 NVL column); "
        f"{_fa2_h100(835.5e12)}",
    ),
    "NVIDIA H200": _profiled("h200", f"{_H200_SXM}; {_FA2_H100}"),
    "NVIDIA A100-SXM4-80GB": _profiled("a100", f"{_A100_SXM_80}; {_FA2_A100}"),
    "NVIDIA A100-SXM4-40GB": Datasheet(
        312e12,
        0.5 * 312e12,
        f"A100 SXM 40 GB HBM2: 312 TFLOP/s dense BF16, 1,555 GB/s ({_A100}, A100 40GB SXM "
        f"column); {_fa2_a100(312e12)}",
    ),
    "NVIDIA A100 80GB PCIe": Datasheet(
        312e12,
        0.5 * 312e12,
        f"A100 PCIe 80 GB HBM2e: 312 TFLOP/s dense BF16, 1,935 GB/s ({_A100}, A100 80GB PCIe "
        f"column); {_fa2_a100(312e12)}",
    ),
    "NVIDIA A100-PCIE-40GB": Datasheet(
        312e12,
        0.5 * 312e12,
        f"A100 PCIe 40 GB HBM2: 312 TFLOP/s dense BF16, 1,555 GB/s ({_A100}, A100 40GB PCIe "
        f"column); {_fa2_a100(312e12)}",
    ),
}

# The share of a device's memory kept free of a rank's measured peak: see `fits`.
HEADROOM = 0.10


def usable(device_bytes: float) -> float:
    """The bytes of a device's memory a rank's peak may take: all but HEADROOM."""
    return device_bytes * (1 - HEADROOM)


# What a GPU holds beside the caching allocator's reserve, where the allocator is
# modelled (advise: predict/allocator.py), each from a cited measurement:
# - the CUDA context: "nvidia-smi shows usage of 781MB" for a process that has only
#   started CUDA through PyTorch (pytorch/pytorch#34323);
# - NCCL's buffers, a set per communicator (NVIDIA/nccl#864: "More communicators =
#   more memory used"): 544 MB for a group of two, 688 MB for more, measured through
#   PyTorch on 4 A100s over NVLink with a 4 MB all-reduce (NVIDIA/nccl#964). NCCL's
#   maintainer adds that it grows with the channels, more on H100's NVLink than there,
#   and no further beyond two nodes: a floor for an H100, not a ceiling.
CUDA_CONTEXT_BYTES = 781 * MiB
NCCL_PAIR_BYTES = 544 * MiB
NCCL_GROUP_BYTES = 688 * MiB


def overhead(groups: list[int]) -> int:
    """A GPU rank's memory beyond the allocator: the CUDA context, and NCCL's buffers
    for each of its process groups of `groups` ranks (one per mesh dimension over
    more than one)."""
    nccl = sum(NCCL_PAIR_BYTES if g == 2 else NCCL_GROUP_BYTES for g in groups if g > 1)
    return CUDA_CONTEXT_BYTES + nccl


def fits(
    peak_bytes: float, device_bytes: float | None, held_bytes: float | None = None
) -> bool | None:
    """Whether a rank fits a device of `device_bytes`; None where the device's memory
    is unknown. The one decision plan, advise and the rehearsal make.

    Where what the device would hold is known (`held_bytes`: advise's reserved peak on
    a GPU, from the caching allocator's model, plus `overhead`), it must fit the card.
    Else the measured peak is allocated bytes (torch's memory trackers) and HEADROOM
    stands for the rest: a tenth of the card kept free (torchtitan's reserved peaks
    ran 11-17% over advise's allocated ones for the same runs; on a CPU, where none of
    it exists, the same tenth is kept)."""
    if not device_bytes:
        return None
    if held_bytes is not None:
        return held_bytes <= device_bytes
    return peak_bytes <= usable(device_bytes)


def from_file(path: Path) -> GPU:
    """A user's profile: YAML or JSON with GPU's fields."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        data = yaml.safe_load(text)
    fields = {f.name for f in dataclasses.fields(GPU)}
    need = {"name", "peak_flops", "achievable_flops", "memory_bytes", "bandwidth", "source"}
    # optional: attention_flops, op_floor_s, fp8_flops
    if not isinstance(data, dict) or (missing := sorted(need - set(data))):
        raise GPUError(f"{path}: a GPU profile needs {sorted(need)}; missing {missing}")
    if unknown := sorted(set(data) - fields):
        raise GPUError(f"{path}: unknown GPU profile keys {unknown}")
    try:
        gpu = GPU(**{k: (v if k in ("name", "source") else float(v)) for k, v in data.items()})
    except (TypeError, ValueError) as e:
        raise GPUError(f"{path}: {e}") from None
    if min(gpu.peak_flops, gpu.achievable_flops, gpu.memory_bytes, gpu.bandwidth) <= 0:
        raise GPUError(f"{path}: rates and sizes must be positive")
    return gpu


def resolve(name_or_file: str) -> GPU:
    """A named profile or a profile file (THIS_MACHINE is measured: fakerank.this_machine)."""
    if name_or_file in PROFILES:
        return PROFILES[name_or_file]
    if Path(name_or_file).is_file():
        return from_file(Path(name_or_file))
    raise GPUError(
        f"gpu {name_or_file!r}: neither a profile ({', '.join(NAMES)}) nor a profile file"
    )


def problem(name_or_file: str) -> str | None:
    """Why `name_or_file` is no GPU profile, without measuring anything."""
    if name_or_file in NAMES:
        return None
    try:
        from_file(Path(name_or_file))
    except (OSError, GPUError) as e:
        return f"neither a profile ({', '.join(NAMES)}) nor a readable profile file ({e})"
    return None
