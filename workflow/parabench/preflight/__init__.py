"""Before a run: `parabench doctor`, and the GPU run rehearsed on fake CUDA tensors
(`parabench rehearse`)."""
