"""Where the host time of permute / unpermute goes (CUDA only).

Times each call with the GPU kept busy by ``torch.cuda._sleep`` (so the host never waits on it),
then prints a cProfile of permute + unpermute forward and backward, sorted by own time.

    python benchmarks/profile_permute_host.py [--T 4096 --H 2048 --E 64 --k 8 --align 16]
"""

from __future__ import annotations

import argparse

import torch
from benchmark_grouped_mlp import sleep_cycles_per_ms
from profile_grouped_mlp_host import host_us, print_host_profile

from moekit.kernels import permute as K
from moekit.ops import permute, unpermute


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--align", type=int, default=0, help="0: no padding")
    args = ap.parse_args()
    T, H, E, k = args.T, args.H, args.E, args.k
    align = args.align or None

    cpm = sleep_cycles_per_ms()

    dev = "cuda"
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    p = torch.rand(T, k, device=dev, requires_grad=True)
    d0 = permute(x, idx, p, num_experts=E, align=align)
    dy = torch.randn(d0.hidden.shape, device=dev, dtype=torch.bfloat16)
    go = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    R = d0.hidden.shape[0]
    expert_out = torch.randn(R, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    flat = idx.reshape(-1).contiguous()

    def perm_fwd_bwd():
        d = permute(x, idx, p, num_experts=E, align=align)
        return torch.autograd.grad(d.hidden, (x,), dy)

    def unperm_fwd_bwd():
        out = unpermute(expert_out, d0)
        return torch.autograd.grad(out, (expert_out,), go)

    rows = {
        "permute fwd (no grad)": lambda: permute(
            x.detach(), idx, p.detach(), num_experts=E, align=align
        ),
        "permute fwd": lambda: permute(x, idx, p, num_experts=E, align=align),
        "permute fwd+bwd": perm_fwd_bwd,
        "unpermute fwd": lambda: unpermute(expert_out, d0),
        "unpermute fwd+bwd": unperm_fwd_bwd,
        "routing_metadata (3 launches)": lambda: K.routing_metadata(
            idx.to(torch.int32), E, align or 1
        ),
        "torch.empty": lambda: torch.empty(R, H, device=dev, dtype=torch.bfloat16),
        "torch index_select": lambda: flat.index_select(0, flat[:16]),
    }
    print(f"host µs per call (GPU kept busy), T={T} H={H} E={E} k={k} align={align}")
    for name, fn in rows.items():
        print(f"  {name:32s} {host_us(fn, 50, cpm):8.1f}")

    def both():
        perm_fwd_bwd()
        unperm_fwd_bwd()

    print_host_profile(both, cpm, 600, (("tottime", 25),))


if __name__ == "__main__":
    main()
