"""The model: configuration, loading, tokenizer, the Llama-family decoder, its attention
backends and RoPE."""
