"""kvpipe: prefill/decode disaggregated LLM serving around a KV-cache transfer engine."""

__version__ = "0.1.0"
