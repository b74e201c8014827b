"""Registers and spills of the grouped-GEMM kernels as this machine's Triton builds them.

Launches the ragged-M kernel once per config on a small problem and prints each compiled
variant's registers per thread, spilled bytes and shared memory, plus the ptxas in use.

    python benchmarks/probe_kernel_registers.py
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton

from moekit.kernels import grouped_gemm as G


def main() -> None:
    print("triton", triton.__version__, "torch", torch.__version__)
    try:
        from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version

        print("ptxas", get_ptxas(90).path, get_ptxas_version(90).strip().splitlines()[-1])
    except Exception as exc:  # the helper moved between Triton versions
        print("ptxas: unknown", exc)
    T, K, N = 4096, 2048, 1536
    for E in (1, 128):
        a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
        offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (T // E)
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        plain = G._RAGGED_M_CANDIDATES_16[0]
        fine = G._ragged_m_candidates(torch.bfloat16, 512 * E, E, K, N)[0]
        for cfg in (fine, plain, dataclasses.replace(plain, expert_groups=False)):
            G.grouped_mm_ragged_m(a, w.transpose(1, 2), offs, out, config=cfg)
    torch.cuda.synchronize()
    dump = os.environ.get("DUMP_DIR")
    for cache in G._grouped_mm_ragged_m_kernel.device_caches.values():
        for i, (key, kernel) in enumerate(cache[0].items()):
            kernel._init_handles()
            if dump:  # the compiler's stages, to compare variants' code offline
                os.makedirs(dump, exist_ok=True)
                for ext in ("ttgir", "ptx", "cubin"):
                    mode = "wb" if ext == "cubin" else "w"
                    with open(os.path.join(dump, f"k{i}.{ext}"), mode) as f:
                        f.write(kernel.asm[ext])
            c = kernel.metadata.constants if hasattr(kernel.metadata, "constants") else {}
            print(
                f"k{i} regs {kernel.n_regs} spills {kernel.n_spills} smem {kernel.metadata.shared}"
                f" stages {kernel.metadata.num_stages} | {str(key)[-160:]} {c}"
            )


if __name__ == "__main__":
    main()
