"""The studies' tests (CPU paths, and the GPU-only ones marked ``gpu``)."""
