"""Engines: one fused forward pass per batch (llama.cpp), and an exact NumPy reference."""

from .base import Engine, EngineCapacity, EngineError, engine_key
from .corrupt import CorruptingEngine
from .gemma import assemble_gemma
from .llama import LlamaCppEngine, bench_engine_decode
from .loader import gguf_sha256
from .reference import NumpyReferenceEngine
from .tiny_model import write_tiny_model
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CorruptingEngine", "Engine", "EngineCapacity", "EngineError", "LlamaCppEngine", "NumpyReferenceEngine",
    "Tokenizer", "assemble_gemma", "bench_engine_decode", "engine_key", "gguf_sha256",
    "load_tokenizer", "write_tiny_model",
]
