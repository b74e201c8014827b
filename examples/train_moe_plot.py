"""The training example's figure: losses (raw, smoothed, validation; other runs of the same
config beside), the router's aux loss, and each expert's share of the tokens per layer."""

from __future__ import annotations

import json
import os

SMOOTH = 25  # steps of the moving average


def moving_average(xs: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= n:
            acc -= xs[i - n]
        out.append(acc / min(i + 1, n))
    return out


def _other_runs(out: str, result: dict) -> dict[str, dict]:
    """Finished runs of the same config in sibling folders (e.g. the torch baseline, or the
    single-GPU run beside an EP one)."""
    found = {}
    parent = os.path.dirname(os.path.abspath(out))
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name, "losses.json")
        if os.path.abspath(os.path.join(parent, name)) == os.path.abspath(out):
            continue
        if os.path.exists(path):
            with open(path) as f:
                other = json.load(f)
            if other.get("config") == result["config"] and other.get("steps") == result["steps"]:
                found[name] = other
    return found


def label(result: dict) -> str:
    ep, world = result.get("ep", 1), result.get("world", 1)
    unit = "GPUs" if result["device"] == "cuda" else "processes"
    where = f"{world} {unit}, EP {ep}" if world > 1 else result["device"]
    return f"{result['baseline']} ({where})"


def save_figure(result: dict, out: str, path: str) -> bool:
    """Write the figure to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, ax_aux, ax_load) = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = {"this run": result, **_other_runs(out, result)}
    for i, r in enumerate(runs.values()):
        steps = range(1, len(r["losses"]) + 1)
        color = f"C{i}"
        if i == 0:
            ax.plot(steps, r["losses"], color=color, lw=0.6, alpha=0.3)
        ax.plot(steps, moving_average(r["losses"], SMOOTH), color=color, lw=1.4,
                label=f"{label(r)}, {SMOOTH}-step mean")  # fmt: skip
        if r.get("val"):
            vs, vl = zip(*r["val"])
            ax.plot(vs, vl, "o", color=color, ms=4, label=f"{label(r)}, validation")
        if r.get("aux"):
            ax_aux.plot(range(1, len(r["aux"]) + 1), moving_average(r["aux"], SMOOTH),
                        color=color, lw=1.2, label=label(r))  # fmt: skip
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"{result['config']}: loss")
    ax.legend(fontsize=7)
    ax_aux.set(xlabel="step", ylabel="aux loss (all layers)", title="load-balancing loss")
    ax_aux.legend(fontsize=7)
    load = result.get("expert_load")
    if not load:
        ax_load.set_axis_off()
        ax_load.text(0.5, 0.5, "no per-expert counts\n(torch-native layers)", ha="center")
    else:
        im = ax_load.imshow(load, aspect="auto", cmap="viridis")
        fig.colorbar(im, ax=ax_load, label="tokens / even share")
        ax_load.set(xlabel="expert", ylabel="layer", title="expert load (this run)",
                    yticks=range(len(load)))  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
