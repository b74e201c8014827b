"""Process-group helpers and the generic symmetric-memory pool.

:func:`init_distributed` and the first :class:`SymmetricPool` set ``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NVSHMEM_DISABLE_NVLS=1`` where unset (moekit never
uses NVLink multicast); a process that creates its groups itself calls
:func:`disable_multicast_env` first where it wants the same. Importing sets nothing.
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
