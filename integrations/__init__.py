"""Adapters for Megatron-Core and NeMo / Megatron-Bridge (installed as ep_plugin.integrations)."""
