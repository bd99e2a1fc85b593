"""One benchmark cell's processes: the cell's record, the measurement loop, the data,
the marked regions of a step, the profiled steps, peak FLOP/s, FLOP counts, injected
faults, and the collectives benchmark."""
