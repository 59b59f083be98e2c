"""Triton kernels, one file per stage, each with its launcher. Users call ``kernels_lib``'s functions,
which validate arguments and allocate outputs; the launchers here take buffers and launch grids."""
