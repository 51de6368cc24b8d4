"""minillm: a small but complete LLM inference engine."""
