"""The plan's prediction against a published table: torchtitan's Llama 3.1 8B with FSDP
on H100, weak scaling from 8 to 128 GPUs. Torch-free.

torchtitan's docs/performance.md (Grand Teton: 8 H100 per host over NVLink, 400 Gb/s
RDMA per GPU between hosts; local batch 2 x sequence 8,192; bf16 parameters, fp32
gradient reduction; selective activation checkpointing) reports 5,762 tokens/s per GPU
at 8 GPUs (Table 1) and 5,605 at 128 (Table 3): 97.3% kept.

From the 8-GPU figure alone and a fabric, the check predicts the 128-GPU one as the
plan predicts any rank: the step at 8 GPUs less its communication is the compute, which
weak scaling keeps; at 128 GPUs the communication is the same collectives on the
fabric across nodes. FSDP's collectives per step are counted as the anatomy counts
them: an all-gather of every parameter in bf16 in the forward and again in the
backward (parameters resharded after the forward), and a reduce-scatter of every
gradient in fp32, each once per transformer block plus once for the root.

The scaling model assumes no communication hidden behind compute (FSDP prefetches its
all-gathers during compute, so the truth lies nearer the 8-GPU step).
"""

from __future__ import annotations

from dataclasses import replace

from parabench.hardware.fabric import Fabric, level
from parabench.predict.scaling import critical_comm

TORCHTITAN = {
    "source": "torchtitan docs/performance.md, Tables 1 and 3 (Llama 3.1 8B, FSDP, H100)",
    "params": 8.03e9,  # Llama 3.1 8B
    "blocks": 32,
    "tokens_per_gpu_step": 2 * 8192,  # local batch 2 x sequence 8,192
    "tokens_per_s_per_gpu": {8: 5762.0, 128: 5605.0},
    "param_bytes": 2,  # bf16 all-gathers
    "grad_bytes": 4,  # fp32 reduce-scatters
}


def fsdp_comm(params: float, calls: int, param_bytes: int, grad_bytes: int) -> dict:
    """FSDP's collectives per step (anatomy.volume's units: calls and bytes, the full
    buffer per call), resharding after the forward."""
    return {
        "all_gather": {"count": 2.0 * calls, "bytes": 2 * params * param_bytes},
        "reduce_scatter": {"count": float(calls), "bytes": params * grad_bytes},
    }


def _comm(fabric: Fabric, comm: dict, n: int) -> float:
    """Seconds per step of `comm` (calls and bytes per op) on `fabric` at n ranks."""

    def time_of(op: str, nbytes: float) -> float:
        return fabric.time(op, n, nbytes)

    return critical_comm([comm], time_of, pipelined=False, m=1)


def _retention(fabric: Fabric, comm: dict, step_lo: float, lo: int, hi: int) -> tuple:
    """(step at hi, comm at lo, comm at hi): the compute of the step at lo GPUs kept."""
    comm_lo, comm_hi = _comm(fabric, comm, lo), _comm(fabric, comm, hi)
    return step_lo - comm_lo + comm_hi, comm_lo, comm_hi


def torchtitan_check(fabric: Fabric) -> dict:
    """The predicted tokens/s per GPU at 128 GPUs and the share kept, against the
    published ones; and what a cross-node bus bandwidth of one GPU's InfiniBand line
    rate (400 Gb/s = 50 GB/s) would predict instead (how much the fabric matters)."""
    t = TORCHTITAN
    lo, hi = sorted(t["tokens_per_s_per_gpu"])
    comm = fsdp_comm(t["params"], t["blocks"] + 1, t["param_bytes"], t["grad_bytes"])
    step_lo = t["tokens_per_gpu_step"] / t["tokens_per_s_per_gpu"][lo]
    # none hidden, at 8 GPUs either: the compute is the 8-GPU step less its comm
    step_hi, comm_lo, comm_hi = _retention(fabric, comm, step_lo, lo, hi)
    line_rate = replace(fabric, tables={**fabric.tables, "inter": level(50)})
    step_nic, *_ = _retention(line_rate, comm, step_lo, lo, hi)
    published = t["tokens_per_s_per_gpu"][hi] / t["tokens_per_s_per_gpu"][lo]
    predicted = step_lo / step_hi
    return {
        "source": t["source"],
        "fabric": fabric.name,
        "fabric_source": fabric.source,
        "gpus": (lo, hi),
        "step_s": step_lo,
        "base_tokens_per_s": t["tokens_per_s_per_gpu"][lo],
        "comm_s": (comm_lo, comm_hi),
        "published_tokens_per_s": t["tokens_per_s_per_gpu"][hi],
        "predicted_tokens_per_s": t["tokens_per_gpu_step"] / step_hi,
        "published_retention": published,
        "predicted_retention": predicted,
        "error": predicted / published - 1,
        "per_gpu_nic_retention": step_lo / step_nic,
    }


# Meta's Llama 3.1 shapes (transformers' llama config keys; untied embeddings, as
# torchtitan's Llama): what advise's torchtitan check builds, on fake tensors.
LLAMA3 = {
    "llama3_8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
    },
    "llama3_70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "num_hidden_layers": 80,
    },
    "llama3_405b": {
        "hidden_size": 16384,
        "intermediate_size": 53248,
        "num_attention_heads": 128,
        "num_key_value_heads": 8,
        "num_hidden_layers": 126,
    },
}


def llama3_model(name: str, seq_len: int = 8192) -> dict:
    """A config's model entry for one of LLAMA3 (arch hf: built from config, no weights)."""
    config = {
        **LLAMA3[name],
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "max_position_embeddings": seq_len,
    }
    return {
        "arch": "hf",
        "model_type": "llama",
        "seq_len": seq_len,
        "batch_size": 1,
        "config": config,
    }


# torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: "Each host has 8 NVIDIA
# H100 GPUs fully connected with NVLink. Each H100 GPU is equipped with 96GB HBM2e with
# 2.4 TB/sec peak memory bandwidth. Hosts are inter-connected with backend RDMA network
# with 400 Gb/s per GPU. We used the default 500W power limit". Sequence 8,192 (its
# train configs); bf16 parameters and fp32 reduction (FSDP2's mixed precision, its
# default); AdamW. Memory is the allocator's reserved peak. Tables 1 and 3 each give
# three runs of one layout: eager, compiled, compiled with Float8 (torchao's, with
# FSDP's Float8 all-gather); Tables 4 and 5 ran compiled with Float8 (their first rows).
_LAYOUTS = {
    "Table 1": {
        "model": "llama3_8b",
        "gpus": 8,
        "dp_shard": 8,
        "tp": 1,
        "pp": 1,
        "ac": "selective",
        "micro": 2,
        "accumulation": 1,
        "zero": 3,
        "schedule": "",
    },
    "Table 3": {
        "model": "llama3_8b",
        "gpus": 128,
        "dp_shard": 128,
        "tp": 1,
        "pp": 1,
        "ac": "selective",
        "micro": 2,
        "accumulation": 1,
        "zero": 3,
        "schedule": "",
    },
    "Table 4": {
        "model": "llama3_70b",
        "gpus": 256,
        "dp_shard": 32,
        "tp": 8,
        "pp": 1,
        "ac": "full",
        "micro": 16,
        "accumulation": 1,
        "zero": 3,
        "schedule": "",
    },
    # torchtitan's pipeline_parallel_microbatches defaults to the stages (its
    # config_manager.py at the benchmark's commit): 8 micro-batches of 4
    "Table 5": {
        "model": "llama3_405b",
        "gpus": 512,
        "dp_shard": 8,
        "tp": 8,
        "pp": 8,
        "ac": "full",
        "micro": 4,
        "accumulation": 8,
        "zero": 2,
        "schedule": "1f1b",
    },
}
_FLOAT8_TP = "Float8 in TP's collectives (torchtitan's Float8 tensor parallel plan)"


def _run(
    table: str,
    run: str,
    compiled: bool,
    float8: bool,
    tps: float,
    gib: float,
    not_modelled: str = "",
    **layout,
) -> dict:
    return {
        "table": table,
        "run": run,
        **_LAYOUTS[table],
        **layout,  # what this run changes of its table's layout
        "compile": compiled,
        "float8": float8,
        "tokens_per_s_per_gpu": tps,
        "memory_gib": gib,
        "not_modelled": not_modelled,
    }


TORCHTITAN_TABLES = (
    _run("Table 1", "FSDP", False, False, 5762.0, 82.4),
    _run("Table 1", "FSDP + torch.compile", True, False, 6667.0, 77.0),
    _run("Table 1", "FSDP + torch.compile + Float8", True, True, 8532.0, 76.8),
    _run("Table 3", "FSDP", False, False, 5605.0, 67.0),
    _run("Table 3", "FSDP + torch.compile", True, False, 6514.0, 62.0),
    _run("Table 3", "FSDP + torch.compile + Float8", True, True, 8380.0, 61.8),
    _run("Table 4", "2D + torch.compile + Float8", True, True, 829.0, 71.9, _FLOAT8_TP),
    _run(
        "Table 5",
        "1F1B, 3D + torch.compile + Float8 + AsyncTP",
        True,
        True,
        100.0,
        82.5,
        f"{_FLOAT8_TP}; AsyncTP (TP's collectives overlapped with its matmuls)",
    ),
    # 2 stages a rank: torchtitan's default for a looped schedule (advise.VIRTUAL_STAGES)
    _run(
        "Table 5",
        "Interleaved 1F1B, 3D + torch.compile + Float8 + AsyncTP",
        True,
        True,
        128.0,
        72.7,
        f"{_FLOAT8_TP}; AsyncTP (TP's collectives overlapped with its matmuls)",
        schedule="interleaved",
    ),
)
TORCHTITAN_SOURCE = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 on 96 GB H100 at "
    "500 W, 400 Gb/s per GPU across hosts)"
)
