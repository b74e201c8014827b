"""Process-group helpers and the generic symmetric-memory pool.

Importing this package sets ``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and
``NVSHMEM_DISABLE_NVLS=1`` where unset (moekit never uses NVLink multicast).
"""

from moekit.distributed.env import (
    NO_MULTICAST_ENV,
    DistInfo,
    disable_multicast_env,
    group_from_name,
    init_distributed,
)
from moekit.distributed.symmetric_pool import (
    DEFAULT_POOL_BYTES,
    SymmetricPool,
    clear_pools,
    get_pool,
    set_pool,
)

disable_multicast_env()

__all__ = [
    "DEFAULT_POOL_BYTES",
    "NO_MULTICAST_ENV",
    "DistInfo",
    "SymmetricPool",
    "clear_pools",
    "disable_multicast_env",
    "get_pool",
    "group_from_name",
    "init_distributed",
    "set_pool",
]
