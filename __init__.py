"""stepline: an LLM inference engine on MLX with continuous batching and an event log."""

__version__ = "0.1.0"
