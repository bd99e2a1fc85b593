"""What a cell's records mean, read without running anything: a step's anatomy, the
equivalence with `single`, the parameters' fingerprint, and the statistics."""
