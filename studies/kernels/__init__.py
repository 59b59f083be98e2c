"""Kernels and kernel configs under study (not on any default route of kernels_lib)."""
