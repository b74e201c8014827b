"""moekit: fused Triton kernels and PyTorch modules for training Mixture-of-Experts models."""

from moekit import nn, ops
from moekit.activations import Activation

__version__ = "0.1.0"
__all__ = ["Activation", "__version__", "nn", "ops"]
