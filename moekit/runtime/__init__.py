"""Launch infrastructure shared by every op: the launch path, its cache, device facts.

This package is the only place in moekit that touches private torch or Triton internals (the
raw CUDA stream, Triton's compiled-kernel launcher); everything above it uses public APIs.
"""
