"""Communication that compute hides, as torch schedules it: one micro-batch's data-
parallel collectives on their own stream beside its compute. Torch-free.

FSDP2 wraps each block, and the root (embedding, norm, head), as a unit, and (torch's
`_fully_shard`, as torchtitan's `apply_fsdp` uses it):

- forward: gathers a unit's parameters before its forward; the gather of the next unit
  is issued as this one's forward begins (its implicit prefetch: the CPU runs ahead of
  the GPU, and FSDP2 keeps one gather ahead), so it runs under this unit's compute;
- backward, in reverse: with ZeRO-3 (reshard after forward) gathers each unit again,
  the next one's issued as this one's backward begins, except the last block's, which
  torchtitan keeps gathered from its forward into the backward (where a rank gathers
  it again, as parabench's cells do, advise prices that measured gather exposed);
  after a unit's
  backward, reduce-scatters its gradients (HSDP: then all-reduces the reduced chunk
  over the replicas), under the next unit's backward;
- DDP: all-reduces each bucket's gradients (bucket_cap_mb, 25 MiB by default) as the
  backward fills it, under the rest of the backward.

The collectives share one stream in the order they are issued (one NCCL communicator
per group, and a GPU runs a rank's collectives one after another); the optimizer waits
for the last reduction. Units are alike (a block's compute and collectives are the
micro-batch's over the units: the root's are averaged in). What the timeline does not
hide is exposed: the first gather, a gather longer than the compute it hides under,
the last reduction.

Not modelled: tensor parallelism's collectives (in the compute's stream, exposed, as
torch runs TP without async TP), a pipeline's (its schedule's timeline is the bubble
model's, predict/scaling.py), and the slowdown of compute sharing the GPU's memory
bandwidth and SMs with NCCL's kernels (NCCL takes some SMs; so hidden communication is
not quite free).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A micro-batch's compute and its data-parallel collectives, scheduled."""

    compute_s: float  # forward and backward, the stream's busy time
    comm_s: float  # every collective's time, hidden or not
    end_s: float  # when the last of either ends

    @property
    def exposed_s(self) -> float:
        """What the step waits on communication for: its end past its compute."""
        return max(self.end_s - self.compute_s, 0.0)

    @property
    def hidden_s(self) -> float:
        return max(self.comm_s - self.exposed_s, 0.0)


def micro_batch(
    forward_s: float,
    backward_s: float,
    units: int,
    gather_s: float,
    reduce_s: float,
    regather: bool,
) -> Timeline:
    """One micro-batch over `units` units, each with forward_s / units of forward and
    backward_s / units of backward (its recompute included), a gather of gather_s
    (0: DDP, nothing gathered) before its forward (and, `regather`, before its backward)
    and a reduction of reduce_s after its backward."""
    units = max(int(units), 1)
    f, b = forward_s / units, backward_s / units
    comm_free = 0.0  # when the collectives' stream is next free

    def issue(at: float, seconds: float) -> float:
        """A collective issued at `at`: when it ends, after those issued before it."""
        nonlocal comm_free
        comm_free = max(comm_free, at) + seconds
        return comm_free

    # forward: unit 0's gather first, each next one issued as the unit before it starts
    t = 0.0
    ready = issue(0.0, gather_s) if gather_s else 0.0
    for i in range(units):
        start = max(t, ready)
        if gather_s and i + 1 < units:
            ready = issue(start, gather_s)
        t = start + f
    # backward, the last unit first: it stays gathered from the forward
    ready = t
    for i in range(units):
        start = max(t, ready)
        if regather and gather_s and i + 1 < units:
            ready = issue(start, gather_s)
        t = start + b
        if reduce_s:
            issue(t, reduce_s)
    gathers = (2 * units - 1 if regather else units) if gather_s else 0
    return Timeline(
        compute_s=forward_s + backward_s,
        comm_s=gathers * gather_s + units * reduce_s,
        end_s=max(t, comm_free),
    )
