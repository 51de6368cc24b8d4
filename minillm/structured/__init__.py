"""Constrained decoding (structured outputs): regex and JSON-schema constraints compiled to a
byte DFA and to per-state token masks that the sampler applies (vLLM's
`vllm/v1/structured_output`, with our own compiler), and context-free grammars (an EBNF subset)
recognized by an Earley parser whose chart yields the masks."""
