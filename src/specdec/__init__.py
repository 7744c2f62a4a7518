"""specdec: lossless speculative decoding on CPU, with an OpenAI-compatible server."""

__version__ = "0.2.0"
