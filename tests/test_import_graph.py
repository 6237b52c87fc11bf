"""The package's import graph: no cycles, and config.py a leaf (plain data).

Walks every module of `openmoe_jax` and `tasks/` with `ast` (nothing is imported),
counting module-level and function-level imports alike. An edge goes to the module
named (`import a.b`, `from a import b` where a/b is a module, else `from a.b import
name` -> a.b); parent packages' `__init__` are not edges (Python runs them first, so
they cannot close a cycle through the child).
"""
import ast
import os
from typing import Dict, List, Optional, Set

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = {"openmoe_jax": os.path.join(REPO, "openmoe_jax"),
         "tasks": os.path.join(REPO, "tasks")}
# tasks/ is installed as openmoe_jax.tasks; either name is the same module.
ALIASES = {"openmoe_jax.tasks": "tasks"}


def _canonical(name: str) -> str:
  for alias, target in ALIASES.items():
    if name == alias or name.startswith(alias + "."):
      return target + name[len(alias):]
  return name


def package_modules() -> Dict[str, str]:
  """Returns {module name: file path} for every .py file under ROOTS."""
  modules = {}
  for package, root in ROOTS.items():
    for folder, _, files in os.walk(root):
      for file in files:
        if not file.endswith(".py"):
          continue
        rel = os.path.relpath(os.path.join(folder, file), root)[:-3].split(os.sep)
        if rel[-1] == "__init__":
          rel = rel[:-1]
        modules[".".join([package] + rel)] = os.path.join(folder, file)
  return modules


def _resolve(name: str, modules) -> Optional[str]:
  """Returns the package module `name` refers to (itself or its nearest parent that
  is a module of ours), or None for outside modules."""
  name = _canonical(name)
  while name:
    if name in modules:
      return name
    name = name.rpartition(".")[0]
  return None


def imports_of(module: str, path: str, modules) -> Set[str]:
  """Returns the package modules `module` imports anywhere in its file."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  is_package = os.path.basename(path) == "__init__.py"
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = module.split(".")
        parent = parts if is_package else parts[:-1]
        parent = parent[:len(parent) - (node.level - 1)]
        base = ".".join(parent + ([base] if base else []))
      names = [f"{base}.{alias.name}" for alias in node.names]
      names = [n if _canonical(n) in modules else base for n in names]
    else:
      continue
    for name in names:
      target = _resolve(name, modules)
      if target is not None and target != module:
        found.add(target)
  return found


def import_graph() -> Dict[str, Set[str]]:
  """Returns {module: the package modules it imports}."""
  modules = package_modules()
  return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
  """Returns one cycle [a, b, ..., a] per strongly connected component that has one."""
  index, low, stack, on_stack, cycles = {}, {}, [], set(), []
  counter = [0]

  def visit(v):  # Tarjan's algorithm
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = set()
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.add(w)
        if w == v:
          break
      if len(component) > 1:
        cycles.append(_cycle_in(graph, component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return cycles


def _cycle_in(graph, component) -> List[str]:
  """Returns a path [a, ..., a] inside `component` (breadth-first from its first)."""
  start = min(component)
  parent = {start: None}
  queue = [start]
  while queue:
    v = queue.pop(0)
    for w in sorted(graph[v] & component):
      if w == start:
        path = [v]
        while parent[path[-1]] is not None:
          path.append(parent[path[-1]])
        return [start] + path[::-1][1:] + [start]
      if w not in parent:
        parent[w] = v
        queue.append(w)
  return sorted(component)


def test_find_cycles_names_a_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert find_cycles(graph) == [["a", "b", "c", "a"]]
  assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_package_import_graph_has_no_cycle():
  graph = import_graph()
  assert "openmoe_jax.moe.layer" in graph and "openmoe_jax.config" in graph
  cycles = find_cycles(graph)
  assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_config_imports_nothing_of_the_package():
  graph = import_graph()
  assert not graph["openmoe_jax.config"], (
      "openmoe_jax/config.py must stay plain data; it imports "
      + ", ".join(sorted(graph["openmoe_jax.config"])))


if __name__ == "__main__":
  pytest.main([__file__])
