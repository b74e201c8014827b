"""Triton kernels and their launchers. Triton only: no autograd, no input validation."""
