"""moekit: fused Triton kernels and PyTorch modules for training Mixture-of-Experts models."""

from moekit import fusion, nn, ops
from moekit.activations import Activation
from moekit.ops.quantize import Fp8Recipe
from moekit.runtime.state import clear as clear_state
from moekit.version import VERSION as __version__

__all__ = ["Activation", "Fp8Recipe", "__version__", "clear_state", "fusion", "nn", "ops"]
