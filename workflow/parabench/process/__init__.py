"""What one rank's process is built on: where it sits (runtime: its rank, device,
threads, process groups and named mesh), the process group whose collectives return at
once (nocomm), its batches (data), the marked regions of its step (marks), and the
FLOPs of a step counted by torch (flops)."""
