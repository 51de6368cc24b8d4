"""minillm.lab.op_trace: the operations an eager function runs and the bytes each moves."""

import pytest
import torch

from minillm.lab.op_trace import OpRecord, total_bytes, trace_ops
from minillm.model.llama import RMSNorm


def test_an_elementwise_op_reads_its_inputs_and_writes_its_output():
    x, y = torch.ones(10, dtype=torch.float16), torch.ones(10, dtype=torch.float16)
    result, ops = trace_ops(torch.add, x, y)
    assert torch.equal(result, x + y)
    assert ops == [OpRecord("add.Tensor", 40, 20)]
    assert ops[0].num_bytes == 60 and total_bytes(ops) == 60


def test_views_and_allocations_are_not_operations():
    x = torch.arange(24.0)

    def fn():
        v = x.view(4, 6).transpose(0, 1)[1:]  # three views over x's memory
        return torch.empty(3), v.contiguous()  # an allocation, then one real copy

    _, ops = trace_ops(fn)
    assert [op.name for op in ops] == ["clone.default"]
    # a view is read as the elements it shows (20 of x's 24)
    assert ops[0].bytes_read == 4 * 20 and ops[0].bytes_written == 4 * 20


def test_in_place_ops_count_the_tensor_they_update():
    x = torch.zeros(8)
    _, ops = trace_ops(lambda: x.add_(1.0).mul_(2.0))
    assert [(op.name, op.bytes_read, op.bytes_written) for op in ops] == [
        ("add_.Tensor", 32, 32),
        ("mul_.Tensor", 32, 32),
    ]
    assert torch.equal(x, torch.full((8,), 2.0))


def test_matmul_bytes_are_both_operands_and_the_product():
    a, b = torch.ones(3, 5), torch.ones(5, 7)
    _, ops = trace_ops(torch.mm, a, b)
    assert ops == [OpRecord("mm.default", 4 * (15 + 35), 4 * 21)]


def test_eager_rmsnorm_with_residual_runs_nine_operations():
    # the engine's torch RMSNorm: add, to float32, pow, mean, + eps, rsqrt, scale, to
    # bfloat16, weight: nine launches where the fused kernel needs one
    rows, n = 4, 64
    norm = RMSNorm(n, 1e-5).to(torch.bfloat16)
    x, residual = torch.randn(rows, n).bfloat16(), torch.randn(rows, n).bfloat16()
    (y, h), ops = trace_ops(norm, x, residual)
    assert len(ops) == 9
    # every op reads and writes whole rows: the adds and casts move the [rows, n] tensors
    assert ops[0] == OpRecord("add.Tensor", 2 * rows * n * 2, rows * n * 2)
    assert ops[1] == OpRecord("_to_copy.default", rows * n * 2, rows * n * 4)
    assert torch.equal(h, x + residual)


def test_no_grad_inside_and_errors():
    w = torch.ones(3, requires_grad=True)
    result, _ = trace_ops(lambda: w * 2)
    assert not result.requires_grad
    with pytest.raises(TypeError, match="fn must be callable"):
        trace_ops(3)


def test_a_decode_step_runs_as_many_operations_at_any_batch_size():
    # the torch backend attends all decode sequences in one batched call, so an eager decode
    # step launches the same operations for 1 sequence or 5 (chapter 5's "Try it")
    from minillm import EngineArgs, LLMEngine, SamplingParams

    counts = []
    for batch in (1, 5):
        engine = LLMEngine(
            EngineArgs(
                device="cpu",
                attention_backend="torch",
                max_num_seqs=8,
                max_model_len=128,
                enable_prefix_caching=False,
            )
        )
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(str(i), list(range(10 + i, 30 + i)), params)
        engine.step()  # prefill
        _, ops = trace_ops(engine.step)
        counts.append(len(ops))
        assert any(op.name == "linear.default" for op in ops)
    assert counts[0] == counts[1] > 100
