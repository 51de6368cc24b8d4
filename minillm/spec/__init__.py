"""Speculative decoding: a cheap proposer guesses k tokens, the target checks them in one forward.

`SpeculativeConfig` (vLLM's configuration shape), the proposers (`DraftModelProposer`, a small
model with its own paged KV cache; `NgramProposer`, prompt lookup in the request's own tokens),
the rejection sampler that keeps the target's distribution exact, and `SpecDecodeRunner`, which
the engine runs in place of its model runner when `speculative_config` is given.
"""
