"""Adapters for Megatron-Core and NeMo / Megatron-Bridge."""
