"""Process-level tuning: the BLAS the CPU path uses, and how memory goes back to the system."""
