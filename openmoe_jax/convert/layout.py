"""The engine that maps our parameter tree to another stack's flat tensor names.

A `Layout` (one per external format: t5x OpenMoE, Hugging Face OpenMoE, Mixtral,
Qwen3-MoE) lists `Rule`s: one external tensor <-> one of our parameters, with the
reshape/transpose between them. Layer rules address a parameter inside one layer's
block; `model.layer_slots` says where that block lives (scanned or not), so no
layout knows about scan segments. Export streams one tensor at a time; import fills
a tree of preallocated numpy leaves one tensor at a time and checks every shape.
"""
import dataclasses
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from openmoe_jax import errors
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import layer_slots

Path = Tuple[str, ...]


class ConversionError(errors.InputError):
  """A checkpoint does not fit the model or the layout (one clear line; programs
  print it without offering a traceback and exit 2)."""


@dataclasses.dataclass(frozen=True)
class Transform:
  """How our array becomes the external one: merge two axes, then maybe swap the
  last two (torch's [out, in] Linear weights)."""

  merge: Optional[str] = None  # None | "last2" (query [d,H,D]) | "first2" (out [H,D,d])
  transpose: bool = False

  def external_shape(self, shape: Sequence[int]) -> Tuple[int, ...]:
    """Returns the external tensor's shape for our parameter shape `shape`."""
    s = list(shape)
    if self.merge == "last2":
      s = s[:-2] + [s[-2] * s[-1]]
    elif self.merge == "first2":
      s = [s[0] * s[1]] + s[2:]
    if self.transpose:
      s[-2], s[-1] = s[-1], s[-2]
    return tuple(s)

  def to_external(self, ours: np.ndarray) -> np.ndarray:
    """Returns our array in the external layout."""
    merged = self.external_shape(ours.shape)
    if self.transpose:
      merged = merged[:-2] + (merged[-1], merged[-2])
    out = ours.reshape(merged)
    return np.ascontiguousarray(np.swapaxes(out, -1, -2)) if self.transpose else out

  def to_ours(self, external: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Returns the external array in our layout of shape `shape`."""
    if self.transpose:
      external = np.swapaxes(external, -1, -2)
    return external.reshape(shape)


COPY = Transform()
T = Transform(transpose=True)


@dataclasses.dataclass(frozen=True)
class Rule:
  """External tensor `external` <-> our parameter at `ours` (inside the layer's block
  for layer rules, from the tree's root for global rules)."""

  external: str
  ours: Path
  transform: Transform = COPY


@dataclasses.dataclass(frozen=True)
class Requirement:
  """An option a layout can express only with some values: `value(cfg)` reads the
  model's setting, which must be one of `allowed`; `option` names it in refusals."""

  option: str
  value: Callable[[ModelConfig], Any]
  allowed: Tuple[Any, ...]

  def ok(self, cfg: ModelConfig) -> bool:
    """Returns whether `cfg`'s setting is one the layout can express."""
    return self.value(cfg) in self.allowed


@dataclasses.dataclass(frozen=True)
class Layout:
  """A named external parameter layout."""

  name: str
  global_rules: Callable[[ModelConfig], List[Rule]]
  layer_rules: Callable[[ModelConfig, int, bool], List[Rule]]
  requirements: Tuple[Requirement, ...] = ()

  def unmet(self, cfg: ModelConfig) -> List[Requirement]:
    """Returns the requirements `cfg` does not meet."""
    return [r for r in self.requirements if not r.ok(cfg)]


def check_supported(cfg: ModelConfig, layout: Layout,
                    others: Sequence[Layout] = ()) -> None:
  """Raises ConversionError naming the first option of `cfg` that `layout` cannot
  express, and which of `others` would take it."""
  unmet = layout.unmet(cfg)
  if not unmet:
    return
  req = unmet[0]
  takers = [o.name for o in others if o.name != layout.name
            and not any(u.option == req.option for u in o.unmet(cfg))]
  where = (f"; layouts that take it: {', '.join(takers)}" if takers
           else "; no layout takes it")
  allowed = " or ".join(repr(a) for a in req.allowed)
  raise ConversionError(f"layout {layout.name!r} cannot express {req.option} = "
                        f"{req.value(cfg)!r} (it needs {allowed}){where}")


def _name(path: Path, layer: Optional[int] = None) -> str:
  return ".".join(([f"layers.{layer}"] if layer is not None else []) + list(path))


def _get(tree: Dict, path: Path):
  for key in path:
    tree = tree[key]
  return tree


def _has(tree: Dict, path: Path) -> bool:
  for key in path:
    if not isinstance(tree, dict) or key not in tree:
      return False
    tree = tree[key]
  return True


def iter_placements(cfg: ModelConfig, layout: Layout
                    ) -> Iterator[Tuple[Rule, Path, Optional[int], Optional[int]]]:
  """Yields (rule, full path in our tree, scan index or None, layer number or None)
  for every tensor of `layout`, globals first, then layers in depth order."""
  for rule in layout.global_rules(cfg):
    yield rule, rule.ours, None, None
  for i, slot in enumerate(layer_slots(cfg)):
    for rule in layout.layer_rules(cfg, i, slot.sparse):
      yield rule, (slot.segment, slot.block) + rule.ours, slot.repeat, i


def export_tensors(params: Dict, cfg: ModelConfig, layout: Layout
                   ) -> Iterator[Tuple[str, np.ndarray]]:
  """Yields (external name, numpy array) for every tensor of `layout`, one at a time
  (params: our unboxed tree; arrays are copied to host one by one)."""
  check_supported(cfg, layout)
  for rule, path, repeat, _ in iter_placements(cfg, layout):
    leaf = _get(params, path)
    ours = np.asarray(leaf if repeat is None else leaf[repeat])
    yield rule.external, rule.transform.to_external(ours)


def import_tensors(read: Callable[[str], np.ndarray], names: Sequence[str],
                   cfg: ModelConfig, layout: Layout, shapes: Dict,
                   dtype=np.float32, progress: Callable[[str], None] = lambda _: None
                   ) -> Dict:
  """Returns our params tree (numpy, `dtype`) filled from external tensors.

  `read(name)` returns one external tensor (called once per tensor, so a lazy
  reader keeps host memory at one tensor plus the tree being filled); `names` is
  every tensor the checkpoint holds; `shapes` our tree of ShapeDtypeStructs (e.g.
  `jax.eval_shape` of `Decoder.init`). Raises ConversionError on a missing tensor,
  a shape that does not fit (naming the parameter and both shapes), a tensor the
  model has no place for, or a parameter no rule fills.
  """
  check_supported(cfg, layout)
  tree = _allocate(shapes, dtype)
  filled: Dict[Path, set] = {}
  used = set()
  available = set(names)
  last_layer = None
  for rule, path, repeat, layer in iter_placements(cfg, layout):
    if not _has(tree, path):
      raise ConversionError(
          f"layout {layout.name!r} maps {rule.external!r} to parameter "
          f"{_name(rule.ours, layer)}, which this gin model does not have")
    if rule.external not in available:
      raise ConversionError(
          f"the checkpoint has no tensor {rule.external!r} (parameter "
          f"{_name(rule.ours, layer)}): is the gin model the one it was trained with?")
    leaf = _get(tree, path)
    shape = leaf.shape[1:] if repeat is not None else leaf.shape
    array = np.asarray(read(rule.external))
    want = rule.transform.external_shape(shape)
    if tuple(array.shape) != want:
      raise ConversionError(
          f"parameter {_name(rule.ours, layer)}: the checkpoint's {rule.external!r} "
          f"has shape {tuple(array.shape)}, the gin model needs {want} "
          f"(ours {tuple(shape)})")
    value = rule.transform.to_ours(array, shape).astype(dtype)
    if repeat is None:
      leaf[...] = value
    else:
      leaf[repeat] = value
    filled.setdefault(path, set()).add(repeat)
    used.add(rule.external)
    if layer is not None and layer != last_layer:
      progress(f"  layer {layer + 1}/{cfg.num_layers}")
      last_layer = layer
  _check_complete(tree, filled, layout)
  unused = sorted(available - used)
  if unused:
    raise ConversionError(
        f"the checkpoint holds {len(unused)} tensor(s) the gin model has no place for, "
        f"e.g. {unused[0]!r}: is the gin model the one it was trained with?")
  return tree


def _allocate(shapes: Dict, dtype) -> Dict:
  if isinstance(shapes, dict):
    return {k: _allocate(v, dtype) for k, v in shapes.items()}
  return np.empty(shapes.shape, dtype)


def _check_complete(tree: Dict, filled: Dict[Path, set], layout: Layout) -> None:
  """Raises ConversionError if a parameter (or one scan index of it) was not filled."""

  def walk(sub, path):
    if isinstance(sub, dict):
      for k, v in sub.items():
        walk(v, path + (k,))
      return
    repeats = filled.get(path, set())
    if None not in repeats and len(repeats) != (sub.shape[0] if repeats else 1):
      raise ConversionError(f"layout {layout.name!r} has no tensor for parameter "
                            f"{'/'.join(path)}: the model uses an option the layout "
                            "cannot carry")
  walk(tree, ())
