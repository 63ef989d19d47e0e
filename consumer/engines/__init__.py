"""Engines: one fused forward pass per batch (llama.cpp), and an exact NumPy reference."""

from .base import Engine, EngineCapacity, EngineError, engine_key

__all__ = ["Engine", "EngineCapacity", "EngineError", "engine_key"]
