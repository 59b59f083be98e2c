"""Our performance studies of kernels_lib: A/Bs, the fused cross-entropy's frontier and past-the-floor runs,
profiles, tuning scripts, and kernels that have not yet won an A/B on a GPU. Outside the package on purpose:
``kernels_lib`` imports nothing from here. Run from the repository root, e.g. ``python -m studies.flce_frontier``;
see ``studies/README.md``.
"""
