"""Every gin file under gin/ parses and, where it configures a model, builds it
abstractly (jax.eval_shape: no parameter memory)."""
import math
import pathlib

import gin
import jax
import jax.numpy as jnp
import pytest

from openmoe_jax import gin_utils
from openmoe_jax.config import ModelConfig
from openmoe_jax.model import Decoder

GIN_ROOT = pathlib.Path(__file__).resolve().parents[1] / "gin"
GIN_FILES = sorted(str(p.relative_to(GIN_ROOT)) for p in GIN_ROOT.rglob("*.gin"))


def test_gin_folder_is_not_empty():
  assert {"runs/quickstart.gin", "models/quickstart_moe.gin",
          "objectives/causal_lm.gin"} <= set(GIN_FILES)


@pytest.mark.parametrize("name", GIN_FILES)
def test_gin_file_parses_and_builds_model(name):
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin([name], finalize=False)
  cfg = ModelConfig()
  if cfg.vocab_size is None:
    cfg = cfg.replace(vocab_size=8320)
  seq = min(cfg.moe.group_size, 128)
  tokens = jax.ShapeDtypeStruct((1, seq), jnp.int32)
  variables = jax.eval_shape(Decoder(cfg).init, jax.random.PRNGKey(0), tokens)
  count = sum(math.prod(x.shape) for x in jax.tree.leaves(variables))
  assert count > 0


def test_openmoe_base_preset_has_the_published_shape():
  gin.clear_config()
  gin_utils.import_configurables()
  gin_utils.parse_gin(["models/openmoe_base_16e.gin"], finalize=False)
  cfg = ModelConfig()
  assert [i for i, s in enumerate(cfg.sparse_layers()) if s] == [3, 7, 11]
  assert (cfg.d_model, cfg.moe.num_experts, cfg.vocab_size) == (768, 16, 256384)
