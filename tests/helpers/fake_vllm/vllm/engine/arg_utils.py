"""As vLLM's: imported by ``vllm serve`` before anything else of the engine (the hooks note it)."""
