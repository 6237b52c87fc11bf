"""Mixture-of-Experts: routers, dispatch engines, auxiliary losses, the MoE block."""
