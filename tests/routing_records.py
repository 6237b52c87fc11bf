"""Test helpers: synthetic routing records (analysis/record.py's RoutingRecord) with
known routing, for the analyses and the report."""
import numpy as np

from openmoe_jax.analysis.record import RoutingRecord

E = 8
SEQ = 64


def synthetic_record(token_n, position_n, expert_lnk, kept_lnk=None, task_n=None,
            task_names=("a",), step=None) -> RoutingRecord:
  """Returns a synthetic record; one choice per token unless expert_lnk says more."""
  n = token_n.size
  expert_lnk = expert_lnk.reshape(expert_lnk.shape[0], n, -1)
  kept_lnk = np.ones(expert_lnk.shape, bool) if kept_lnk is None else kept_lnk
  return RoutingRecord(
      token=token_n.astype(np.int32), position=position_n.astype(np.int32),
      doc_position=position_n.astype(np.int32),
      task=np.zeros(n, np.int16) if task_n is None else task_n.astype(np.int16),
      row=np.arange(n, dtype=np.int32) // SEQ, expert=expert_lnk.astype(np.int16),
      gate=np.where(kept_lnk, 0.5, 0.0).astype(np.float16), kept=kept_lnk,
      task_names=list(task_names), num_experts=E, sequence_length=SEQ,
      moe_layers=list(range(1, 2 * expert_lnk.shape[0], 2)), step=step)


def tokens_positions(n=20000, vocab=60, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, vocab, n), np.tile(np.arange(SEQ), n // SEQ + 1)[:n], rng
