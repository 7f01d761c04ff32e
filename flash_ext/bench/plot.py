"""The PNG plot, in the style of the FlashAttention papers: TFLOP/s bars per backend and sequence length,
one panel per head dim x mask."""
import os
import sys
import warnings

from .records import backend_name, order_backends
from .report import MODE_TITLES, rows_for_mode

BACKEND_COLORS = {  # fixed per backend, so every panel and every run uses the same colour
    "flash_ext": "#d62728",  # red: ours
    "flash_ext_no_window": "#ff9896",  # light red: ours without --window / --softcap
    "flash_ext_no_softcap": "#e377c2",
    "flash_ext_dense": "#8c564b",  # brown: ours, dense, the yardstick of --varlen (same work)
    "fa3": "#9467bd",
    "sdpa_cudnn": "#2ca02c",
    "sdpa_flash": "#1f77b4",
    "sdpa_efficient": "#ff7f0e",
    "sdpa_math": "#7f7f7f",
    "sdpa_nested": "#bcbd22",
    "flex": "#17becf",
}
EXTRA_COLORS = ("#8c564b", "#e377c2", "#bcbd22", "#393b79", "#637939")


def backend_color(key):
    return BACKEND_COLORS.get(key) or EXTRA_COLORS[sum(map(ord, key)) % len(EXTRA_COLORS)]


def plot_panels(records, mode):
    """[((headdim, causal), [shape, ...])] in the order panels are drawn: head dims down, masks across."""
    panels = {}
    for shape, _ in rows_for_mode(records, mode):
        panels.setdefault((shape.headdim, shape.causal), []).append(shape)
    return sorted(panels.items(), key=lambda kv: kv[0])


def write_plot(path, records, mode, gpu_name=None, dtype="bf16", backends=None):
    """Grouped bars (TFLOP/s per backend) per sequence length, one panel per head dim x mask.

    Returns the path written, or None (with a warning on stderr) if matplotlib is missing or there
    is nothing timed to plot."""
    try:  # optional: the tables and the JSON do not need it
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except Exception as e:  # ImportError, or a broken install
        print(f"warning: matplotlib is not importable ({e}); no plot written", file=sys.stderr)
        return None
    mode_records = [r for r in records if r.mode == mode]
    backends = backends or order_backends(r.backend for r in mode_records)
    plotted = [k for k in backends if any(r.timed() for r in mode_records if r.backend == k)]
    panels = plot_panels(records, mode)
    if not panels or not plotted:
        print(f"warning: nothing timed in mode {mode}; no plot written", file=sys.stderr)
        return None
    headdims = sorted({hd for (hd, _), _ in panels})
    masks = sorted({c for (_, c), _ in panels})
    fig_h = 3.6 * len(headdims) + 0.9  # + room for the title and the legend
    fig, axes = plt.subplots(len(headdims), len(masks), figsize=(6.2 * len(masks), fig_h), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    rows = dict(rows_for_mode(records, mode))
    nb = len(plotted)
    width = 0.8 / nb
    handles = {}
    for (hd, causal), shapes in panels:
        ax = axes[headdims.index(hd)][masks.index(causal)]
        ax.set_visible(True)
        labels = [s.seq_label() for s in shapes]
        if len(set(labels)) != len(labels):  # several shapes share a sequence length: say which is which
            labels = [f"{s.seq_label()}\nb{s.batch} {s.heads_label()}" for s in shapes]
        ymax = 0.0
        for bi, key in enumerate(plotted):
            bars = [(xi + (bi - (nb - 1) / 2) * width, rows[s][key].tflops)
                    for xi, s in enumerate(shapes) if key in rows[s] and rows[s][key].timed()]
            if not bars:
                continue
            xs, ys = zip(*bars)
            handles.setdefault(key, ax.bar(xs, ys, width=width * 0.95, color=backend_color(key),
                                           label=backend_name(key), zorder=3))
            ymax = max(ymax, *ys)
            for x, y in bars:
                ax.text(x, y, f"{y:.0f}", ha="center", va="bottom", fontsize=5 if nb > 3 else 6.5,
                        rotation=90 if nb > 4 else 0)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_xlim(-0.6, len(shapes) - 0.4)
        ax.set_ylim(0, ymax * 1.18 if ymax > 0 else 1)
        ax.set_xlabel("Sequence length", fontsize=8)
        ax.set_ylabel("Speed (TFLOP/s)", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3, zorder=0)
        ax.set_title(f"{'Causal' if causal else 'Non-causal'}, head dim {hd}", fontsize=9)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    title = f"Attention {MODE_TITLES.get(mode, mode)} speed ({dtype}" + (f", {gpu_name})" if gpu_name else ")")
    fig.suptitle(title, fontsize=11, y=1 - 0.12 / fig_h, va="top")
    keys = [k for k in plotted if k in handles]
    fig.legend([handles[k] for k in keys], [backend_name(k) for k in keys], loc="upper center",
               ncol=min(len(keys), 7), fontsize=8, frameon=False, bbox_to_anchor=(0.5, 1 - 0.42 / fig_h))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tight_layout's warnings about the legend's room
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig_h))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path
