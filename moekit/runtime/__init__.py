"""Launch infrastructure shared by every op: the launch path, its cache, device facts.

Private torch or Triton internals are confined to this package (the raw CUDA stream, the
dispatch-mode stack, Triton's compiled-kernel launcher, tensor and storage reference counts)
and to moekit.distributed (torch's symmetric-memory module and process-group registry, which
have no public equivalent).
"""
