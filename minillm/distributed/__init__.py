"""Inference over several processes: tensor, pipeline and expert parallelism, and
prefill/decode disaggregation, over `torch.distributed` (gloo on the CPU, NCCL on GPUs).

The engine spawns its workers itself (`executor`), one process per rank; each builds its share
of the model (`tensor_parallel`, `pipeline`), and the scheduler's plan of every step goes to all
of them. `parallel_state` holds the process group and the counting communicator,
`parallel_layers` the sharded linears and the vocabulary-parallel embedding and LM head,
`expert_parallel` the dispatch and combine of a mixture-of-experts layer whose experts are
spread over the ranks, and `disaggregation` the prefill and decode ranks and the KV transfers
between them.
"""
