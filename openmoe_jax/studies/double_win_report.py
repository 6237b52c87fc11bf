"""The double-win study's report (studies/double_win.py): the table, the plot of
held-out NLL against epochs, every number as JSON, and the two answers, each with
its evidence and no claim beyond what was measured.

(a) Does MoE help the diffusion LM more than the autoregressive one? MoE gain =
    dense NLL - MoE NLL for each objective; the answer compares the two gains with
    the Monte Carlo standard error of the diffusion bounds (the AR numbers are exact
    on the held-out tokens).
(b) Is there an epoch count after which DLM beats AR? The DLM number is an upper
    bound on its NLL, so a DLM bound below the AR NLL is a real win for DLM; the
    crossover is the first scored checkpoint from which the bound stays below.
"""
import json
import math
import os
from typing import Any, Dict, List

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

# How many standard errors a difference must exceed to count as measured.
Z = 2.0
ARM_ORDER = ("ar_dense", "dlm_dense", "ar_moe", "dlm_moe")


def _final(arm: Dict) -> Dict:
  return arm["curve"][-1]


def _best(arm: Dict) -> Dict:
  return min(arm["curve"], key=lambda row: row["nll"])


def _gain(results: Dict, objective: str, pick) -> Dict[str, float]:
  dense = pick(results["arms"][f"{objective}_dense"])
  moe = pick(results["arms"][f"{objective}_moe"])
  return {"gain": dense["nll"] - moe["nll"],
          "stderr": math.hypot(dense["stderr"], moe["stderr"])}


def gains(results: Dict) -> Dict[str, Dict[str, Any]]:
  """Returns the MoE gains (dense - MoE NLL) per objective and their difference
  (DLM gain - AR gain) with standard errors, at the final and at the best
  checkpoint of each arm."""
  out = {}
  for when, pick in (("final", _final), ("best", _best)):
    ar, dlm = _gain(results, "ar", pick), _gain(results, "dlm", pick)
    out[when] = {"ar": ar, "dlm": dlm,
                 "difference": {"value": dlm["gain"] - ar["gain"],
                                "stderr": math.hypot(ar["stderr"], dlm["stderr"])}}
  return out


def crossover(results: Dict, model: str) -> Dict[str, Any]:
  """Returns where the DLM bound of `model` ("dense"/"moe") goes and stays below the
  AR NLL by more than Z standard errors: {"epoch": first such scored epoch or None,
  "previous_epoch": the scored epoch before it (None: from the first), "gaps": AR -
  DLM per scored checkpoint}."""
  ar, dlm = results["arms"][f"ar_{model}"]["curve"], results["arms"][f"dlm_{model}"]["curve"]
  rows = list(zip(ar, dlm))
  below = [a["nll"] - d["nll"] > Z * d["stderr"] for a, d in rows]
  first = None
  for i in range(len(rows)):
    if all(below[i:]):
      first = i
      break
  return {"epoch": None if first is None else rows[first][0]["epochs"],
          "previous_epoch": None if not first else rows[first - 1][0]["epochs"],
          "gaps": [{"epochs": a["epochs"], "ar_minus_dlm": a["nll"] - d["nll"],
                    "stderr": d["stderr"]} for a, d in rows]}


def ar_turn_up(arm: Dict) -> Dict[str, float]:
  """Returns the best and the final NLL of an arm and their epochs."""
  best, final = _best(arm), _final(arm)
  return {"best": best["nll"], "best_epoch": best["epochs"], "final": final["nll"],
          "final_epoch": final["epochs"], "rise": final["nll"] - best["nll"]}


def _verdict(value: float, stderr: float, yes: str, no: str, neither: str) -> str:
  if value > Z * stderr and value > 0:
    return yes
  if value < -Z * stderr and value < 0:
    return no
  return neither


def answers(results: Dict) -> List[str]:
  """Returns the two answers, (a) and (b), each with its evidence, and the AR
  over-fitting check, as lines of text."""
  g = gains(results)
  lines = []
  for when in ("final", "best"):
    d = g[when]
    verdict = _verdict(d["difference"]["value"], d["difference"]["stderr"],
                       "yes", "no: MoE helps AR more",
                       "not distinguishable from equal")
    lines.append(
        f"(a) MoE helps DLM more than AR ({when} checkpoints): {verdict}. MoE gain AR "
        f"{d['ar']['gain']:+.4f}, DLM {d['dlm']['gain']:+.4f} ± {d['dlm']['stderr']:.4f}"
        f" nats/token; difference {d['difference']['value']:+.4f} ± "
        f"{d['difference']['stderr']:.4f} (yes/no needs > {Z:g} standard errors).")
  for model in ("dense", "moe"):
    c = crossover(results, model)
    last = c["gaps"][-1]
    if c["epoch"] is None:
      lines.append(
          f"(b) {model}: no crossover within {last['epochs']:.1f} epochs: at the end "
          f"AR - DLM = {last['ar_minus_dlm']:+.4f} nats/token (DLM bound ± "
          f"{last['stderr']:.4f}).")
    else:
      since = ("from the first scored checkpoint" if c["previous_epoch"] is None else
               f"between epoch {c['previous_epoch']:.1f} and {c['epoch']:.1f}")
      lines.append(
          f"(b) {model}: DLM beats AR {since} and stays ahead to the end (epoch "
          f"{last['epochs']:.1f}: AR - DLM = {last['ar_minus_dlm']:+.4f} ± "
          f"{last['stderr']:.4f} nats/token; the DLM number is an upper bound, so "
          "its true NLL is lower still).")
  for model in ("dense", "moe"):
    ar, dlm = (_best(results["arms"][f"{o}_{model}"]) for o in ("ar", "dlm"))
    winner = "AR" if ar["nll"] < dlm["nll"] else "DLM"
    lines.append(
        f"(b) {model}, best against best (AR with early stopping): AR {ar['nll']:.4f} "
        f"at epoch {ar['epochs']:.1f}, DLM bound {dlm['nll']:.4f} ± {dlm['stderr']:.4f}"
        f" at epoch {dlm['epochs']:.1f}: {winner} lower by "
        f"{abs(ar['nll'] - dlm['nll']):.4f} nats/token.")
  for model in ("dense", "moe"):
    t = ar_turn_up(results["arms"][f"ar_{model}"])
    turned = "turns up" if t["rise"] > 0 else "does not turn up"
    lines.append(
        f"AR {model} validation NLL {turned}: best {t['best']:.4f} at epoch "
        f"{t['best_epoch']:.1f}, final {t['final']:.4f} at epoch "
        f"{t['final_epoch']:.1f} ({t['rise']:+.4f}).")
  lines.append("One seed per arm: the standard errors cover the Monte Carlo noise of "
               "the DLM bound only, not seed-to-seed variation.")
  return lines


def _nll(row: Dict) -> str:
  spread = f" ± {row['stderr']:.3f}" if row["bound"] else ""
  return f"{row['nll']:.4f}{spread}"


def format_table(results: Dict) -> str:
  """Returns the per-arm table and the gains as aligned text."""
  header = (f"{'arm':<10} {'activated':>10} {'final NLL':>16} {'best NLL':>16} "
            f"{'best @ep':>8} {'epochs':>7} {'tok/s':>7}")
  lines = [header, "-" * len(header)]
  for name in ARM_ORDER:
    arm = results["arms"][name]
    final, best = _final(arm), _best(arm)
    activated = results["parameters"][arm["model"]]["activated"]
    tps = arm.get("tokens_per_sec")
    lines.append(f"{name:<10} {activated:>10,} {_nll(final):>16} {_nll(best):>16} "
                 f"{best['epochs']:>8.1f} {final['epochs']:>7.1f} "
                 f"{(tps or math.nan):>7.0f}")
  g = gains(results)
  lines.append("")
  for when in ("final", "best"):
    d = g[when]
    lines.append(f"MoE gain ({when}): AR {d['ar']['gain']:+.4f}, DLM "
                 f"{d['dlm']['gain']:+.4f} ± {d['dlm']['stderr']:.4f}; DLM - AR "
                 f"{d['difference']['value']:+.4f} ± {d['difference']['stderr']:.4f}")
  lines.append("NLL in nats per held-out token: exact for AR, the negative ELBO (an "
               "upper bound, ± its standard error) for DLM.")
  return "\n".join(lines)


def plot(results: Dict, path: str) -> str:
  """Plots held-out NLL against epochs for the four arms (DLM with ± 1 standard
  error bars); returns `path`."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  styles = {"ar": "-", "dlm": "--"}
  colors = {"dense": "tab:blue", "moe": "tab:orange"}
  for name in ARM_ORDER:
    arm = results["arms"][name]
    epochs = [row["epochs"] for row in arm["curve"]]
    nll = [row["nll"] for row in arm["curve"]]
    label = f"{arm['objective'].upper()} {arm['model']}" + (
        " (ELBO bound)" if arm["objective"] == "dlm" else " (exact)")
    ax.errorbar(epochs, nll, yerr=[row["stderr"] for row in arm["curve"]],
                linestyle=styles[arm["objective"]], color=colors[arm["model"]],
                marker="o", markersize=3, capsize=2, label=label)
  ax.set_xlabel("epochs over the unique training tokens")
  ax.set_ylabel("held-out NLL (nats / token)")
  data = results["data"]
  ax.set_title(f"AR vs diffusion, dense vs MoE: {data['train_tokens']:,} unique tokens")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _routing_md(results: Dict) -> List[str]:
  lines = []
  for name in ("ar_moe", "dlm_moe"):
    routing = results["arms"][name].get("routing")
    if not routing:
      continue
    epochs_per_step = results["arms"][name]["curve"][-1]["epochs"] / max(
        results["arms"][name]["curve"][-1]["step"], 1)
    cells = ", ".join(f"epoch {s * epochs_per_step:.1f}: {v:.3f}"
                      for s, v in zip(routing["steps"], routing["mean_to_final"]))
    lines.append(f"- {name}: {cells} (full report: {routing['report']})")
  return lines


def write_report(results: Dict, output: str) -> Dict[str, str]:
  """Writes report.md, double_win.png and double_win.json into `output`; returns
  their paths."""
  paths = {"markdown": os.path.join(output, "report.md"),
           "plot": os.path.join(output, "double_win.png"),
           "json": os.path.join(output, "double_win.json")}
  plot(results, paths["plot"])
  summary = {"gains": gains(results),
             "crossover": {m: crossover(results, m) for m in ("dense", "moe")},
             "ar_turn_up": {m: ar_turn_up(results["arms"][f"ar_{m}"])
                            for m in ("dense", "moe")},
             "answers": answers(results)}
  with open(paths["json"], "w") as f:
    json.dump({**results, "summary": summary}, f, indent=1)
  p, data, s = results["parameters"], results["data"], results["settings"]
  lines = [
      "# Double win: diffusion + MoE, and the data-repetition crossover", "",
      f"Four arms, same data, seed ({s['seed']}), batch ({s['batch_size']} x "
      f"{s['sequence_length']}) and steps ({s['steps']}).",
      f"- Activated parameters per token: dense {p['dense']['activated']:,}, MoE "
      f"{p['moe']['activated']:,} (the difference is the MoE router's "
      f"{p['moe']['router']:,} weights); total: dense {p['dense']['total']:,}, MoE "
      f"{p['moe']['total']:,}.",
      f"- Data: {data['train_tokens']:,} unique training tokens ({data['train_documents']}"
      f" documents), repeated; {data['validation_tokens']:,} held-out tokens from "
      f"{data['validation_documents']} documents that never enter training.",
      f"- Models: {s['dense_gin']} and {s['moe_gin']}; run file {s['run_gin']}; extra "
      f"bindings: {s['bindings'] or 'none'}; backend {results['backend']}; training "
      f"{sum(a['seconds'] for a in results['arms'].values()) / 60:.1f} min summed over "
      f"the arms (evaluation and routing analysis not included); this invocation "
      f"{results['seconds'] / 60:.1f} min.",
      "", "```", format_table(results), "```", "",
      "![held-out NLL against epochs](double_win.png)", "", "## Answers", "",
      *[f"- {line}" for line in answers(results)], "",
      "## Routing is learned early (MoE arms)", "",
      "Mean top-expert overlap of each kept checkpoint with the final one "
      "(`openmoe-analyze` on the arm's checkpoints):", "", *_routing_md(results), ""]
  with open(paths["markdown"], "w") as f:
    f.write("\n".join(lines))
  return paths
