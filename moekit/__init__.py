"""moekit: fused Triton kernels and PyTorch modules for training Mixture-of-Experts models."""

from moekit import nn, ops

__version__ = "0.1.0"
__all__ = ["__version__", "nn", "ops"]
