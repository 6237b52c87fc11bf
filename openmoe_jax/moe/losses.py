"""Router auxiliary losses (ST-MoE), computed in float32 per group and averaged."""
import jax
import jax.numpy as jnp


def load_balancing_loss(probs_gse: jax.Array, expert_index_gsk: jax.Array) -> jax.Array:
  """Returns E^2 * mean_e(f_e * p_e), averaged over groups.

  f_e is the fraction of tokens that chose e anywhere in their top-k (before capacity
  truncation) and p_e the mean router probability of e. Under uniform routing it
  equals k; routing that piles onto few experts scores higher.
  """
  num_experts = probs_gse.shape[-1]
  chose_gse = jnp.max(jax.nn.one_hot(expert_index_gsk, num_experts, dtype=jnp.float32),
                      axis=-2)
  f_ge = jnp.mean(chose_gse, axis=1)
  p_ge = jnp.mean(probs_gse.astype(jnp.float32), axis=1)
  return jnp.mean(f_ge * p_ge) * num_experts ** 2


def router_z_loss(logits_gse: jax.Array) -> jax.Array:
  """Returns the mean over tokens of logsumexp(router logits)^2."""
  lse_gs = jax.nn.logsumexp(logits_gse.astype(jnp.float32), axis=-1)
  return jnp.mean(lse_gs ** 2)


def tokenwise_load_balancing_loss(logits_ute: jax.Array, kept_ute: jax.Array,
                                  top_k: float) -> jax.Array:
  """Returns OpenMoE 2's token-wise load-balancing loss for expert choice.

  Per routing unit u (a group or a sequence of t tokens): sum over tokens of
  (sum over experts of the softmax over tokens of the logits) x (number of experts
  that took the token) / (E * k), averaged over units. Equals 1 under uniform logits
  with every token taken by k experts; larger when high-scoring tokens collect more
  experts than others.
  """
  num_experts = logits_ute.shape[-1]
  mass_ut = jnp.sum(jax.nn.softmax(logits_ute.astype(jnp.float32), axis=1), axis=-1)
  count_ut = jnp.sum(kept_ute.astype(jnp.float32), axis=-1)
  return jnp.mean(jnp.sum(mass_ut * count_ut, axis=1)) / (num_experts * top_k)
