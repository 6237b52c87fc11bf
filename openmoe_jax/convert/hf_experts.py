"""Expert tensors under the names transformers writes on disk.

The layout engine maps one external tensor to one of our parameters, and our
experts are one parameter [E, in, out]. transformers 5.x holds experts fused in
memory (`mlp.experts.gate_up_proj` [E, 2f, d], `mlp.experts.down_proj` [E, d, f]),
but `save_pretrained` writes them back in the original per-expert form
(`...experts.{j}.w1.weight` [f, d]; 4.x only knows that form), and loads either.

So a layout names a whole expert stack with `*` in place of the expert number
(`model.layers.3.mlp.experts.*.gate_proj.weight`, shape [E, f, d]); `split_stacks`
turns export output into per-expert tensors, `stack_reader` presents per-expert
(and fused in-memory) checkpoints to the engine as stacks, so the engine's shape
checks and refusals see one tensor per parameter.
"""
import re
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple

import numpy as np

from openmoe_jax.convert.layout import ConversionError

STACK = "*"
Reader = Callable[[str], np.ndarray]
_PER_EXPERT = re.compile(r"^(?P<head>.*\.experts)\.(?P<j>\d+)\.(?P<tail>.+)$")
_FUSED = re.compile(r"^(?P<layer>.*\.layers\.\d+)\.mlp\.(?P<rest>experts\.gate_up_proj|"
                    r"experts\.down_proj|gate\.weight)$")


def is_stack(name: str) -> bool:
  """Returns whether `name` stands for a stack of per-expert tensors."""
  return f".{STACK}." in name


def split_stacks(tensors: Iterable[Tuple[str, np.ndarray]]
                 ) -> Iterator[Tuple[str, np.ndarray]]:
  """Yields (name, array) with every stack [E, ...] split into E per-expert tensors
  named with the expert number in place of `*`; other tensors pass unchanged."""
  for name, array in tensors:
    if not is_stack(name):
      yield name, array
      continue
    for j in range(array.shape[0]):
      yield name.replace(f".{STACK}.", f".{j}.", 1), np.ascontiguousarray(array[j])


def stack_reader(read: Reader, names: Sequence[str]) -> Tuple[Reader, List[str]]:
  """Returns (read, names) in which per-expert tensors `...experts.{j}.X` appear as
  one stack `...experts.*.X` [E, ...] (read stacks them in expert order).

  Raises ConversionError when a stack's experts are not numbered 0..E-1 or their
  shapes differ.
  """
  groups: Dict[str, Dict[int, str]] = {}
  plain = []
  for name in names:
    m = _PER_EXPERT.match(name)
    if m is None:
      plain.append(name)
    else:
      stack = f"{m['head']}.{STACK}.{m['tail']}"
      groups.setdefault(stack, {})[int(m["j"])] = name
  for stack, members in groups.items():
    if sorted(members) != list(range(len(members))):
      missing = sorted(set(range(max(members) + 1)) - set(members))
      raise ConversionError(f"the checkpoint's experts {stack!r} are not numbered "
                            f"0..{len(members) - 1}: expert {missing[0]} is missing")

  def read_stacked(name: str) -> np.ndarray:
    if name not in groups:
      return read(name)
    members = groups[name]
    arrays = [np.asarray(read(members[j])) for j in range(len(members))]
    for j, array in enumerate(arrays):
      if array.shape != arrays[0].shape:
        raise ConversionError(
            f"the checkpoint's {members[j]!r} has shape {array.shape}, "
            f"but {members[0]!r} has {arrays[0].shape}")
    return np.stack(arrays)

  return read_stacked, plain + sorted(groups)


def fused_reader(read: Reader, names: Sequence[str], moe: str, gate: str, up: str,
                 down: str) -> Tuple[Reader, List[str]]:
  """Returns (read, names) in which transformers' in-memory MoE names (what
  `save_pretrained(save_original_format=False)` writes) appear as the layout's
  stacks: `L.mlp.experts.gate_up_proj` [E, 2f, d] as `L.{moe}.experts.*.{gate}.weight`
  (first half) and `...*.{up}.weight`, `L.mlp.experts.down_proj` as
  `...*.{down}.weight`, `L.mlp.gate.weight` as `L.{moe}.gate.weight`."""
  aliases: Dict[str, Tuple[str, int]] = {}  # ours -> (fused name, half: -1 all)
  plain = []
  for name in names:
    m = _FUSED.match(name)
    if m is None:
      plain.append(name)
      continue
    base = f"{m['layer']}.{moe}."
    stack = f"{base}experts.{STACK}."
    if m["rest"] == "gate.weight":
      aliases[base + "gate.weight"] = (name, -1)
    elif m["rest"] == "experts.down_proj":
      aliases[f"{stack}{down}.weight"] = (name, -1)
    else:
      aliases[f"{stack}{gate}.weight"] = (name, 0)
      aliases[f"{stack}{up}.weight"] = (name, 1)

  def read_fused(name: str) -> np.ndarray:
    if name not in aliases:
      return read(name)
    source, half = aliases[name]
    array = np.asarray(read(source))
    if half < 0:
      return array
    f = array.shape[1] // 2
    return array[:, :f] if half == 0 else array[:, f:]

  return read_fused, plain + sorted(aliases)
