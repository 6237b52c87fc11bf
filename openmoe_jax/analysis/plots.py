"""One PNG per analysis (matplotlib, Agg backend): titled, labelled axes, legends.

Each function takes the dict its analysis returned and a path; returns the path.
"""
from typing import Dict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top


def _save(fig, path: str) -> str:
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_specialization_scores(result: Dict, path: str) -> str:
  """Bars per MoE layer: routing explained by token id vs by position (1 = fully)."""
  layers = [str(x["layer"]) for x in result["per_layer"]]
  x = np.arange(len(layers))
  fig, ax = plt.subplots(figsize=(6, 4))
  for offset, key, label in ((-0.2, "token", "token id"),
                             (0.2, "position", result["position_field"])):
    ax.bar(x + offset, [l[key]["score"] for l in result["per_layer"]], 0.4, label=label)
  ax.axhline(0.0, color="gray", linewidth=0.8)
  ax.set_xticks(x, [f"layer {l}" for l in layers])
  ax.set_ylim(min(-0.05, ax.get_ylim()[0]), 1.05)
  ax.set_xlabel("MoE layer")
  ax.set_ylabel("share of top-1 routing entropy explained\n(chance-corrected)")
  ax.set_title("Token-ID specialization: token id vs position")
  ax.legend()
  return _save(fig, path)


def _expert_heatmaps(matrices, row_labels, layers, *, title, row_title, colorbar,
                     cmap, vmax, path, figsize) -> str:
  """Saves one [rows, experts] heatmap per MoE layer side by side; returns `path`."""
  fig, axes = plt.subplots(1, len(matrices), figsize=figsize, squeeze=False,
                           layout="constrained")
  image = None
  for i, (ax, matrix) in enumerate(zip(axes[0], matrices)):
    ax.set_title(f"layer {layers[i]}")
    if not np.size(matrix):  # e.g. no token frequent enough to be shown
      ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
      continue
    image = ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=0, vmax=vmax)
    # Rows are the same in every panel: label them once.
    ax.set_yticks(range(len(row_labels)), row_labels if i == 0 else [], fontsize=7)
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_xlabel("expert")
    if i == 0:
      ax.set_ylabel(row_title)
  fig.suptitle(title)
  if image is not None:
    fig.colorbar(image, ax=axes[0].tolist(), label=colorbar)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def plot_token_expert_distribution(result: Dict, path: str) -> str:
  """Heatmaps per MoE layer: the most frequent tokens' top-1 expert distribution."""
  dists = result["token_expert_distribution"]
  return _expert_heatmaps(
      [np.array(d["distribution"]) for d in dists],
      [repr(t)[:14] for t in dists[0]["text"]] if dists else [],
      [d["layer"] for d in dists],
      title="Top-1 expert distribution of the most frequent tokens",
      row_title="token (most frequent first)",
      colorbar="share of the token's occurrences", cmap="viridis", vmax=1.0, path=path,
      figsize=(1.5 + 3.2 * len(dists), 8))


def plot_drop_by_position(result: Dict, path: str) -> str:
  """Drop rate by position bucket: one curve per task (left); per layer and per
  choice rank (right)."""
  edges = np.array(result["bucket_edges"])
  centers = (edges[:-1] + edges[1:]) / 2
  fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
  for ax, key, what in ((axes[0], "by_task", "task"), (axes[1], "by_layer", "MoE layer and choice")):
    for name, rates in result[key].items():
      y = [np.nan if r is None else r for r in rates]
      label = name if key == "by_task" else f"layer {name}"
      ax.plot(centers, y, marker="o", label=label)
    if key == "by_layer":
      for rank, rates in result.get("by_choice_rank", {}).items():
        ax.plot(centers, [np.nan if r is None else r for r in rates], linestyle="--",
                marker="x", label=f"choice {rank} only (all layers)")
    ax.set_xlabel(f"{result['position_field']} in sequence (bucket centre)")
    ax.set_title(f"Drop rate by position, per {what}")
    ax.legend()
    ax.grid(alpha=0.3)
  axes[0].set_ylabel("dropped share of top-k choices")
  return _save(fig, path)


def plot_routing_stability(result: Dict, path: str) -> str:
  """Overlap of frequent tokens' top expert with the final and previous checkpoint."""
  steps = result["steps"]
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, result["mean_to_final"], marker="o", label="vs final checkpoint")
  consecutive = [np.nan if v is None else v for v in result["mean_consecutive"]]
  ax.plot(steps, consecutive, marker="s", label="vs previous checkpoint")
  for name, curve in result["to_final"].items():
    ax.plot(steps, curve, linestyle=":", alpha=0.6, label=f"layer {name} vs final")
  ax.axhline(result["chance"], color="gray", linestyle="--",
             label=f"chance (1/E = {result['chance']:.3f})")
  ax.set_ylim(0, 1.05)
  ax.set_xlabel("training step")
  ax.set_ylabel(f"share of {result['num_tokens']} frequent tokens\nwith the same top expert")
  ax.set_title("Early routing learning: top-expert overlap across checkpoints")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  return _save(fig, path)


def plot_domain_load(result: Dict, path: str) -> str:
  """Heatmap per MoE layer: expert load (share of top-k choices) per task."""
  load_tle = np.array(result["load"])
  num_layers = load_tle.shape[1]
  return _expert_heatmaps(
      [load_tle[:, l] for l in range(num_layers)], result["tasks"], result["layers"],
      title="Domain specialization: expert load per task", row_title="task",
      colorbar="share of top-k choices", cmap="magma", vmax=float(load_tle.max()),
      path=path, figsize=(1.5 + 3.5 * num_layers, 1.8 + 0.45 * len(result["tasks"])))
