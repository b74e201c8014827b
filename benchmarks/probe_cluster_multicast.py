"""Does this Triton emit TMA multicast on Hopper? (No GPU needed: compiles for sm_90.)

Sharing a weight tile between the CTAs of a cluster with TMA multicast (one L2 read, written
into two SMs' shared memory) is the lever left for the fine-grained ragged-M grouped GEMM, whose
tiles are bound by operand traffic from L2 (docs/grouped_gemm.md). This probe compiles a
persistent tensor-descriptor matmul for sm_90 with ``num_ctas`` 1 and 2 and reports whether the
cluster launch took and whether any TMA load multicasts, and whether Gluon's Hopper TMA copy takes
a multicast argument. Re-run it after a Triton upgrade.

    python benchmarks/probe_cluster_multicast.py
"""

from __future__ import annotations

import inspect
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _persistent_matmul(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, NUM_SMS: tl.constexpr):  # fmt: skip
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [K, 1], [BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [K, 1], [BN, BK])
    c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [N, 1], [BM, BN])
    tiles_n = tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BM) * tiles_n, NUM_SMS, flatten=True):
        pm = tile // tiles_n
        pn = tile % tiles_n
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(tl.cdiv(K, BK)):
            acc = tl.dot(a_desc.load([pm * BM, k * BK]), b_desc.load([pn * BN, k * BK]).T, acc)
        c_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


def compile_for_sm90(num_ctas: int) -> str:
    src = ASTSource(
        fn=_persistent_matmul,
        signature={"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32",
                   "K": "i32", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
                   "NUM_SMS": "constexpr"},
        constexprs={"BM": 128, "BN": 256, "BK": 64, "NUM_SMS": 132},
    )  # fmt: skip
    opts = {"num_ctas": num_ctas, "num_warps": 8, "num_stages": 3}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]


def main() -> None:
    print(f"triton {triton.__version__}, target sm_90")
    for num_ctas in (1, 2):
        ptx = compile_for_sm90(num_ctas)
        cluster = re.search(r"\.reqnctapercluster\s+(\d+)", ptx)
        tma_loads = re.findall(r"cp\.async\.bulk\.tensor\.\d+d\.shared::\S+\.global\S*", ptx)
        print(
            f"  num_ctas={num_ctas}: cluster size {cluster.group(1) if cluster else 1}, "
            f"{len(tma_loads)} TMA loads, of which multicast: "
            f"{sum('multicast' in s for s in tma_loads)}"
        )
    try:
        from triton.experimental.gluon.language.nvidia.hopper import tma

        params = inspect.signature(tma.async_copy_global_to_shared).parameters
        print(f"  gluon hopper tma.async_copy_global_to_shared parameters: {list(params)}")
        print(f"  ... has a multicast parameter: {'multicast' in params}")
    except (ImportError, AttributeError) as exc:
        print(f"  gluon hopper TMA copy not found: {exc}")


if __name__ == "__main__":
    main()
