"""report.md (numbers, plots linked, how to read them) and report.json (every number)."""
import json
import math
import os
from typing import Dict, Optional


def format_number(x: Optional[float]) -> str:
  """Returns `x` with 3 decimals, or "n/a" for None or NaN (no data)."""
  return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _specialization_md(spec: Dict) -> list:
  lines = ["## Token-ID specialization", "",
           f"Share of top-1 routing entropy explained (chance-corrected; 1 = determined, "
           f"0 = independent) by token id vs by `{spec['position_field']}`, over tokens "
           f"seen >= {spec['min_count']} times ({spec['coverage']:.1%} of tokens).", "",
           "| MoE layer | token id score | position score | token consistency "
           "(chance) | position consistency (chance) |", "|---|---|---|---|---|"]
  for layer in spec["per_layer"]:
    tok, pos = layer["token"], layer["position"]
    cells = [format_number(x) for x in (
        tok["score"], pos["score"], tok["consistency"], tok["consistency_chance"],
        pos["consistency"], pos["consistency_chance"])]
    lines.append(f"| {layer['layer']} | {cells[0]} | {cells[1]} | {cells[2]} "
                 f"({cells[3]}) | {cells[4]} ({cells[5]}) |")
  lines += ["", f"**Mean: token id {format_number(spec['token_score'])}, position "
            f"{format_number(spec['position_score'])}.**", "",
            "![specialization](specialization_scores.png)", "",
            "![token expert distribution](token_expert_distribution.png)", "",
            "Top tokens per expert (last MoE layer; tokens whose most common expert it "
            "is, most frequent first; share routed there):", ""]
  last = spec["top_tokens_per_expert"][-1]
  for e, tokens in enumerate(last["experts"]):
    shown = ", ".join(f"`{t['text']!r}` ({t['share']:.0%})" for t in tokens[:8])
    lines.append(f"- expert {e}: {shown or '(owns no frequent token)'}")
  return lines + [""]


def _drops_md(drops: Dict) -> list:
  edges = drops["bucket_edges"]
  header = " | ".join(f"{edges[i]}-{edges[i + 1] - 1}" for i in range(len(edges) - 1))
  lines = ["## Drop towards the end", "",
           f"Dropped share of top-k choices by `{drops['position_field']}` bucket (the "
           "capacity is filled in sequence order within a group: all 1st choices "
           "before any 2nd choice with the choice_major priority, token by token "
           "with position_major).", "",
           f"| | {header} | overall | first quarter | last quarter |",
           "|---" * (len(edges) + 3) + "|"]
  first = drops.get("first_quarter_by_task", {})
  for task, rates in drops["by_task"].items():
    lines.append(f"| {task} | " + " | ".join(format_number(r) for r in rates)
                 + f" | {format_number(drops['overall_by_task'][task])} | "
                 f"{format_number(first.get(task))} | "
                 f"{format_number(drops['last_quarter_by_task'][task])} |")
  for layer, rates in drops["by_layer"].items():
    lines.append(f"| layer {layer} (all tasks) | " + " | ".join(format_number(r) for r in rates)
                 + " | | | |")
  for rank, rates in drops.get("by_choice_rank", {}).items():
    lines.append(f"| choice {rank} only (all tasks, layers) | "
                 + " | ".join(format_number(r) for r in rates) + " | | | |")
  return lines + ["", "![drops](drop_by_position.png)", ""]


def _stability_md(stab: Dict) -> list:
  lines = ["## Early routing learning", "",
           f"Share of the {stab['num_tokens']} frequent tokens (>= {stab['min_count']} "
           "occurrences) whose most common top-1 expert is the same as in the final / "
           f"previous checkpoint (mean over MoE layers; chance {stab['chance']:.3f}).", "",
           "| step | vs final | vs previous |", "|---|---|---|"]
  for step, fin, prev in zip(stab["steps"], stab["mean_to_final"], stab["mean_consecutive"]):
    lines.append(f"| {step} | {format_number(fin)} | {format_number(prev)} |")
  return lines + ["", "![stability](routing_stability.png)", ""]


def _domain_md(load: Dict) -> list:
  lines = ["## Domain specialization", "",
           "Expert load (share of top-k choices) per task; total variation distance "
           "between tasks per MoE layer (0 = same load, 1 = disjoint experts):", ""]
  for pair, tv in load["total_variation"].items():
    lines.append(f"- {pair}: " + ", ".join(
        f"layer {l}: {format_number(v)}" for l, v in zip(load["layers"], tv)))
  return lines + ["", "![domain load](domain_load.png)", ""]


def write_report(output_dir: str, results: Dict) -> Dict[str, str]:
  """Writes report.md and report.json into `output_dir`; returns their paths.

  `results` holds `meta` and any of `specialization`, `drops`, `stability`,
  `domain_load` (the analyses' dicts); plots are expected next to the report.
  """
  meta = results["meta"]
  lines = ["# Routing analysis", "",
           f"Model dir `{meta['model_dir']}`, analysed checkpoint step {meta['step']}, "
           f"tasks {', '.join(meta['tasks'])}, {meta['num_tokens']} tokens "
           f"(up to {meta['num_batches']} batches of {meta['batch_size']} x "
           f"{meta['sequence_length']} per task, packed={meta['pack']}; rows with real "
           f"tokens per task: {meta.get('rows_per_task')}), "
           f"training capacity factor {meta['capacity_factor']}, token-choice "
           f"priority {meta.get('priority') or 'n/a'}.", ""]
  sections = (("specialization", _specialization_md), ("drops", _drops_md),
              ("stability", _stability_md), ("domain_load", _domain_md))
  for key, render in sections:
    if key in results:
      lines += render(results[key])
  md_path = os.path.join(output_dir, "report.md")
  json_path = os.path.join(output_dir, "report.json")
  with open(md_path, "w") as f:
    f.write("\n".join(lines))
  with open(json_path, "w") as f:
    json.dump(results, f, indent=1)
  return {"markdown": md_path, "json": json_path}
