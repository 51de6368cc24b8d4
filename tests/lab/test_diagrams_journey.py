"""The diagrams of the preface and chapters 1-2 show the engine's own names and state."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil

import pytest

import minillm
from minillm.core.metrics import StepTrace
from minillm.lab import roofline
from minillm.lab.catalog import get_model_config
from minillm.lab.diagrams import journey
from minillm.lab.hardware import get_device
from minillm.outputs import CompletionOutput, RequestOutput

ROOT = pathlib.Path(__file__).resolve().parents[2]


def output(num_prompt: int, num_output: int, finish_reason: str = "stop") -> RequestOutput:
    completion = CompletionOutput(
        0, "x" * num_output, list(range(num_output)), None, finish_reason, None
    )
    return RequestOutput("r", "def f():", list(range(num_prompt)), [completion], True, None)


@pytest.mark.parametrize("stage", journey.JOURNEY, ids=lambda s: s.name)
def test_every_stage_names_code_that_exists(stage):
    for ref, name, file in zip(stage.code, stage.names, stage.files, strict=True):
        obj = journey.resolve(ref)
        assert callable(obj), ref
        assert obj.__qualname__ == name
        assert (ROOT / "minillm" / file).exists(), file
        assert pathlib.Path(importlib.import_module(ref.split(":")[0]).__file__) == (
            ROOT / "minillm" / file
        )


def test_resolve_rejects_a_name_that_is_not_there():
    with pytest.raises(AttributeError):
        journey.resolve("minillm.core.scheduler:Scheduler.no_such_method")


def test_journey_boxes_carry_the_stage_code_and_the_request_counts():
    canvas = journey.draw_request_journey(output(13, 36), kv_bytes_per_token=3072)
    text = "\n".join(canvas.labels())
    for stage in journey.JOURNEY:
        for name in stage.names:
            assert name in text, name
    assert "13 token ids" in text
    assert "prefill 13 tokens, then 35 \u00d7 decode 1" in text
    assert "48 tokens \u00d7 3,072 bytes = 147,456 bytes" in text  # 13 + 36 - 1 cached
    assert 'finish_reason="stop"' in text and "36 tokens" in text


def test_journey_changes_with_the_request():
    text = "\n".join(journey.draw_request_journey(output(5, 3, "length"), 100).labels())
    assert "5 token ids" in text and 'finish_reason="length"' in text
    assert "7 tokens \u00d7 100 bytes = 700 bytes" in text


def test_request_steps_reads_the_scheduler_trace():
    traces = [
        StepTrace(0, [("a", 8, "prefill"), ("b", 4, "prefill")], []),
        StepTrace(1, [("a", 1, "decode"), ("b", 1, "decode")], []),
        StepTrace(2, [("b", 1, "decode")], []),
    ]
    assert journey.request_steps(traces, "a") == [8, 1]
    assert journey.request_steps(traces, "b") == [4, 1, 1]


def counts(canvas) -> list[int]:
    return [int(label) for label in canvas.labels()]


def test_kv_cache_rows_count_the_positions_each_pass_computes():
    steps = [4, 1, 1, 1]
    canvas = journey.draw_kv_cache_reuse(steps, [f"t{i}" for i in range(7)])
    without, cached = counts(canvas)[:4], counts(canvas)[4:]
    assert without == [4, 5, 6, 7]
    assert cached == steps
    p, n = 4, 4  # N P + N (N - 1) / 2 positions without a cache, P + N - 1 with one
    assert sum(without) == n * p + n * (n - 1) // 2
    assert sum(cached) == p + n - 1


def test_kv_cache_follows_a_chunked_prefill():
    canvas = journey.draw_kv_cache_reuse([3, 2, 1], list("abcdef"))
    assert counts(canvas) == [3, 5, 6, 3, 2, 1]


def test_kv_cache_needs_a_text_per_position():
    with pytest.raises(ValueError, match="5 token texts for 6 positions"):
        journey.draw_kv_cache_reuse([5, 1], list("abcde"))


def test_engine_step_shows_the_traced_plan():
    trace = StepTrace(7, [("a", 1, "decode"), ("b", 1, "decode"), ("d", 15, "prefill")], [], 2)
    text = "\n".join(journey.draw_engine_step(trace).labels())
    assert "a: D1, b: D1, d: P15; 2 waiting" in text
    assert "17 tokens in one batch" in text
    for name in (
        "Scheduler.schedule",
        "ModelRunner.execute_model",
        "Scheduler.update_from_output",
        "OutputProcessor.detokenize",
    ):
        assert name.split(".")[-1] in dir(
            journey.resolve(
                {
                    "Scheduler": "minillm.core.scheduler:Scheduler",
                    "ModelRunner": "minillm.worker.model_runner:ModelRunner",
                    "OutputProcessor": "minillm.engine.output_processor:OutputProcessor",
                }[name.split(".")[0]]
            )
        )
        assert name in text


def test_step_traffic_numbers_are_the_roofline_counts():
    cost = roofline.decode_step_cost(get_model_config("Llama 3.1 8B"), 1, 4096)
    h100 = get_device("H100 SXM")
    peak = h100.peak_flops("bfloat16")
    text = "\n".join(journey.draw_step_traffic(cost, h100, peak, "t").labels())
    assert f"{cost.weight_bytes / 1e9:.2f} GB, read once" in text
    assert f"{cost.kv_bytes / 1e6:.1f} MB, read once" in text
    assert f"{cost.flops / 1e9:,.1f} GFLOP" in text
    floor_ms = cost.min_bytes / h100.memory_bandwidth_bytes_per_s * 1e3
    assert f"floor {floor_ms:.2f} ms: memory-bound" in text
    assert f"{h100.num_compute_units} SMs" in text


def test_step_traffic_of_a_long_prefill_is_compute_bound():
    cost = roofline.prefill_cost(get_model_config("Llama 3.1 8B"), 4096)
    h100 = get_device("H100 SXM")
    peak = h100.peak_flops("bfloat16")
    text = "\n".join(journey.draw_step_traffic(cost, h100, peak, "t").labels())
    assert f"floor {cost.flops / peak * 1e3:.2f} ms: compute-bound" in text


def test_book_map_draws_every_package_and_real_chapters():
    drawn = {name for name, _, _ in journey.PACKAGES}
    engine_parts = {
        f"minillm.{m.name}"
        for m in pkgutil.iter_modules(minillm.__path__)
        if m.ispkg and m.name not in ("cli", "bundled", "training")
    }
    assert drawn == engine_parts | {"kernels"}
    labels = journey.draw_book_map().labels()
    assert len(labels) == len(journey.PACKAGES)
    chapter_files = {int(p.name[:2]): p for p in (ROOT / "book").glob("[01][0-9]_*.md")}
    for (name, what, chapters), label in zip(journey.PACKAGES, labels, strict=True):
        importlib.import_module(name)
        assert label.splitlines()[:2] == [name, what]
        for number in chapters:
            assert number in chapter_files, (name, number)
        first = min(chapters)
        if first:  # the chapter that opens a package mentions it or one of its modules
            page = chapter_files[first].read_text(encoding="utf-8")
            package = importlib.import_module(name)
            modules = [m.name for m in pkgutil.iter_modules(package.__path__)]
            mentions = [name, name.replace(".", "/") + "/", *modules]
            assert any(m in page for m in mentions), (name, first)


def test_schedule_draws_a_cell_per_scheduled_request_and_step():
    traces = [
        StepTrace(4, [("a", 24, "prefill"), ("b", 9, "prefill")], [], 1),
        StepTrace(5, [("a", 1, "decode"), ("b", 1, "decode")], []),
        StepTrace(6, [("a", 1, "decode"), ("c", 15, "prefill")], []),
    ]
    canvas = journey.draw_schedule([("t", traces, ["a", "b", "c"])])
    assert canvas.labels() == ["24", "9", "15"]  # prefill cells hold their token counts
    cells = canvas.boxes[:-2]  # the last two boxes are the legend's
    assert len(cells) == 6
    # columns are steps counted from the run's first step; rows are requests top to bottom
    xs = sorted({round(x) for x, _, _, _, _ in cells})
    assert len(xs) == 3 and xs[2] - xs[0] == 2
    (c_box,) = [b for b in cells if b[4] == "15"]
    (a_box,) = [b for b in cells if b[4] == "24"]
    assert c_box[1] < a_box[1] and round(c_box[0]) == xs[2]
