"""The compiled MoE-layer programs that benchmarks/moe_layer.py times, as numbers that
do not depend on machine load: XLA's cost analysis (FLOPs, bytes accessed) and the
loss value, per config x dispatcher (the --quick token count).

Two checkouts give the same numbers exactly when a change left the timed programs
as they were (a refactor), which no timing on a shared machine can show:

  python benchmarks/program_cost.py /path/to/old_checkout > old.json
  python benchmarks/program_cost.py .                      > new.json
  diff old.json new.json
"""
import json
import os
import sys


def main(argv=None) -> int:
  """Prints one JSON object {config/dispatcher: {flops, bytes, loss}}; returns 0."""
  argv = sys.argv[1:] if argv is None else argv
  repo = os.path.abspath(argv[0] if argv else os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))))
  sys.path[:0] = [repo, os.path.join(repo, "benchmarks")]
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # pylint: disable=g-import-not-at-top
  import moe_layer  # pylint: disable=g-import-not-at-top  (the checkout's own)
  out = {}
  for name, (d_model, d_ff, experts, top_k, _) in moe_layer.CONFIGS.items():
    shape = (d_model, d_ff, experts, top_k, moe_layer.QUICK_TOKENS)
    for dispatcher in moe_layer.DEFAULT_DISPATCHERS:
      fn, params, x_btd, ct_btd = moe_layer.moe_problem(shape, dispatcher)
      compiled = jax.jit(fn).lower(params, x_btd, ct_btd).compile()
      cost = compiled.cost_analysis()
      cost = cost[0] if isinstance(cost, list) else cost
      loss, _ = compiled(params, x_btd, ct_btd)
      out[f"{name}/{dispatcher}"] = {"flops": cost.get("flops"),
                                     "bytes": cost.get("bytes accessed"),
                                     "loss": float(loss)}
  print(json.dumps(out, sort_keys=True, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
