"""The engine: `LLMEngine` and its options, the output processor, the engine's metrics."""
