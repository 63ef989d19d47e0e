"""Engines: one fused forward pass per batch (llama.cpp: engines/llama.py), and an exact NumPy reference
(engines/reference.py). Only the interface is loaded here: importing an engine is the caller's choice."""

from .base import Engine, EngineCapacity, EngineError, EngineOutput, LogitsEngine, engine_key

__all__ = ["Engine", "EngineCapacity", "EngineError", "EngineOutput", "LogitsEngine", "engine_key"]
