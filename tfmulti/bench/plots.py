"""The bench's PNG plots (matplotlib, when installed): steps/s per method
and replicas, replica scaling, all-reduce time per configuration, and
accuracy against bytes between workers."""

from __future__ import annotations

import os


def plots(results: dict, out_dir: str, *, labels: dict, methods) -> list[str]:
    """Writes the PNG plots; returns their file names ([] w/o matplotlib).
    `labels`: a method's legend; `methods(figures)`: the methods measured
    (the report's)."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.ticker
    from matplotlib import pyplot as plt

    written = []
    step = results["step_overhead"]
    if step:
        fig, axes = plt.subplots(1, len(step), figsize=(6 * len(step), 4),
                                 squeeze=False)
        for ax, (model, by_n) in zip(axes[0], step.items()):
            ns = sorted(by_n, key=int)
            names = methods(by_n[ns[0]])
            width = 0.8 / len(names)
            for i, method in enumerate(names):
                ax.bar([k + i * width for k in range(len(ns))],
                       [by_n[n].get(method, 0) for n in ns], width,
                       label=labels.get(method, method))
            ax.set_xticks([k + 0.4 - width / 2 for k in range(len(ns))],
                          [f"N={n}" for n in ns])
            ax.set_ylabel("steps/s")
            ax.set_title(f"{model}: steps/s per method and replicas")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "steps_per_s.png"), dpi=80)
        plt.close(fig)
        written.append("steps_per_s.png")
    scaling = results["replica_overhead"]
    if scaling:
        fig, ax = plt.subplots(figsize=(6, 4))
        for model, by_method in scaling.items():
            for method, by_n in by_method.items():
                ns = sorted(by_n, key=int)
                ax.plot([int(n) for n in ns], [by_n[n] for n in ns],
                        marker="o", label=f"{model}: "
                        f"{labels.get(method, method)}")
        ax.axhline(1.0, color="grey", linestyle=":")
        ax.set_xlabel("simulated replicas N (same cores, same global batch)")
        ax.set_ylabel("examples/s at N / at 1")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "scaling.png"), dpi=80)
        plt.close(fig)
        written.append("scaling.png")
    comm = results.get("communication")
    if comm:
        fig, ax = plt.subplots(figsize=(7, 4))
        names = list(comm["configs"])
        ax.bar(names, [comm["configs"][n]["seconds_per_step"] * 1e3
                       for n in names])
        ax.set_ylabel("ms per all-reduce")
        ax.set_title(f"{comm['workers']} workers, {comm['params']:,} params")
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "communication.png"), dpi=80)
        plt.close(fig)
        written.append("communication.png")
    reduced = (results.get("communication_reduction") or {}).get("configs")
    if reduced:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, f in reduced.items():
            ax.scatter(f["inter_worker_bytes_per_example"],
                       100 * f["test_accuracy"])
            ax.annotate(name, (f["inter_worker_bytes_per_example"],
                               100 * f["test_accuracy"]), fontsize=7)
        ax.set_xscale("log")
        # Decade labels only: the minor ones overlap.
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("bytes between workers per training example")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title("2 workers x 2 replicas, same examples seen")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "communication_reduction.png"),
                    dpi=80)
        plt.close(fig)
        written.append("communication_reduction.png")
    return written
