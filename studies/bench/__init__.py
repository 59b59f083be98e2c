"""What the studies measure with, beside kernels_workbench.bench: timing views, A/B arms, readings."""
