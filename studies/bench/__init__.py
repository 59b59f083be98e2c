"""What the studies measure with, beside kernels_lib.workbench.bench: timing views, A/B arms, readings."""
