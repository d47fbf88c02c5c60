"""The event model and its wire formats: the record types, the msgpack codec (vLLM-compatible
envelope and tagged events, the engines' dialects), and the JSON codec (LLM API shape)."""
