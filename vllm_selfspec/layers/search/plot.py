"""The search plot (PNG): estimated speedup per trial, and the chosen skip pattern per layer."""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_selfspec.layers.search.optimize import ScoredSkipSet

_PHASE_COLORS = {"seed": "tab:purple", "probe": "tab:gray", "greedy": "tab:orange",
                 "tpe": "tab:blue", "gp": "tab:blue", "local": "tab:green"}


def plot_search(
    trials: Sequence[ScoredSkipSet],
    best: ScoredSkipSet,
    top: Sequence[ScoredSkipSet],
    num_layers: int,
    path: str | os.PathLike[str],
    title: str = "",
    searchable: Sequence[int] | None = None,
) -> None:
    """Write the plot: (1) estimated speedup of every trial by phase with the running best,
    (2) the chosen skip pattern (attention / MLP per layer), (3) how often each sub-layer is
    skipped among the top candidates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(
        3, 1, figsize=(max(8.0, 0.28 * num_layers + 3), 8.5),
        gridspec_kw={"height_ratios": [3.0, 1.0, 1.0]},
    )
    ax = axes[0]
    xs = np.arange(len(trials))
    speedups = np.array([t.speedup for t in trials])
    for phase in dict.fromkeys(t.phase for t in trials):
        idx = [i for i, t in enumerate(trials) if t.phase == phase]
        ax.scatter(xs[idx], speedups[idx], s=14, color=_PHASE_COLORS.get(phase, "tab:green"),
                   label=phase, alpha=0.8)
    nonempty = np.array([t.speedup if t.skip.size else -np.inf for t in trials])
    if len(trials):
        ax.plot(xs, np.maximum.accumulate(nonempty), color="black", lw=1.2, label="best so far")
    ax.axhline(1.0, color="red", lw=0.8, ls="--", label="plain decoding")
    ax.set_xlabel("trial")
    ax.set_ylabel("estimated speedup")
    ax.legend(loc="lower right", fontsize=8, ncol=3)
    ax.set_title(title or "selfspec-profile search", fontsize=10)
    ax.grid(alpha=0.3)

    def grid(ax, values: np.ndarray, cmap: str, label: str) -> None:
        ax.imshow(values, aspect="auto", cmap=cmap, vmin=0, vmax=1, interpolation="nearest")
        ax.set_yticks([0, 1], ["attention", "MLP"])
        ax.set_xticks(range(num_layers), [str(i) for i in range(num_layers)], fontsize=7)
        ax.set_xticks(np.arange(-0.5, num_layers), minor=True)
        ax.set_yticks([0.5], minor=True)
        ax.grid(which="minor", color="white", lw=1)
        ax.tick_params(which="minor", length=0)
        ax.set_ylabel(label, fontsize=8)
        if searchable is not None:
            for layer in range(num_layers):
                if layer not in searchable:
                    ax.axvspan(layer - 0.5, layer + 0.5, color="black", alpha=0.08)

    chosen = np.zeros((2, num_layers))
    for layer in best.skip.attention:
        chosen[0, layer] = 1
    for layer in best.skip.mlp:
        chosen[1, layer] = 1
    grid(axes[1], chosen, "Greens", "chosen")
    axes[1].set_title(
        f"chosen: skip {len(best.skip.attention)} attention + {len(best.skip.mlp)} MLP "
        f"sub-layers, a={best.acceptance:.3f}, k={best.k}, c_draft={best.c_draft:.3f}, "
        f"est. {best.speedup:.3f}x", fontsize=9,
    )
    freq = np.zeros((2, num_layers))
    for cand in top:
        for layer in cand.skip.attention:
            freq[0, layer] += 1
        for layer in cand.skip.mlp:
            freq[1, layer] += 1
    if top:
        freq /= len(top)
    grid(axes[2], freq, "Blues", f"top {len(top)}")
    axes[2].set_xlabel("layer (shaded: never skipped)")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)
    plt.close(fig)
