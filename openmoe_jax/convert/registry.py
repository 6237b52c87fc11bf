"""Every external layout by name, and the refusal check across all of them."""
from typing import Callable, Dict, Tuple

from openmoe_jax.config import ModelConfig
from openmoe_jax.convert import hf_native
from openmoe_jax.convert.layout import ConversionError, Layout, check_supported
from openmoe_jax.convert.openmoe import HF_OPENMOE, T5X_OPENMOE, openmoe_hf_config

T5X = T5X_OPENMOE
# name -> (layout, config.json builder)
HF_LAYOUTS: Dict[str, Tuple[Layout, Callable[[ModelConfig], dict]]] = {
    "openmoe": (HF_OPENMOE, openmoe_hf_config),
    "mixtral": (hf_native.MIXTRAL, hf_native.mixtral_hf_config),
    "qwen3_moe": (hf_native.QWEN3_MOE, hf_native.qwen3_moe_hf_config),
    "glm4_moe": (hf_native.GLM4_MOE, hf_native.glm4_moe_hf_config),
}
_MODEL_TYPES = {"OpenMoeForCausalLM": "openmoe", "MixtralForCausalLM": "mixtral",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Glm4MoeForCausalLM": "glm4_moe"}


def check(cfg: ModelConfig, layout: Layout) -> None:
  """Raises ConversionError naming the first option `layout` cannot express and the
  layouts that would take it."""
  check_supported(cfg, layout, hf_native.all_layouts())


def layout_of(config_json: dict) -> str:
  """Returns the layout name of a Hugging Face config.json (by its architectures)."""
  for arch in config_json.get("architectures") or ():
    if arch in _MODEL_TYPES:
      return _MODEL_TYPES[arch]
  raise ConversionError(
      f"config.json architectures {config_json.get('architectures')} match no layout "
      f"({', '.join(sorted(HF_LAYOUTS))}); pass --layout")
