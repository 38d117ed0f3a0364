"""Embedded vLLM-style inference engine: paged KV cache, continuous batching, vLLM `load_weights` contract."""
