"""Chapter 8's diagrams show the engine's own sharding, ranges and schedules."""

import pytest

from minillm.distributed.expert_parallel import expert_range
from minillm.distributed.pipeline import stage_layers
from minillm.lab.diagrams import distributed as d
from minillm.model.loader import DEFAULT_MODEL, load_model


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL, dtype="float32").model


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_mlp_draws_the_real_shard_shapes(model, tp):
    config = model.config
    h, i = config.hidden_size, config.intermediate_size
    labels = d.draw_tensor_parallel_mlp(model, tp, num_tokens=5).labels()
    assert sum(f"[{i // tp}, {h}] each" in lab for lab in labels) == tp  # gate, up per rank
    assert sum(f"down\n[{h}, {i // tp}]" == lab for lab in labels) == tp  # row-parallel
    assert sum(f"[5, {i // tp}]" in lab for lab in labels) == tp  # each rank's activation
    assert labels[-1] == f"Σ all-\nreduce\n[5, {h}]"
    # the shards are the engine's: they cover the full weight, no overlap
    shards = d.tensor_parallel_mlp_shards(model, tp)
    full = model.model.layers[0].mlp.down_proj.weight
    assert sum(s.shape[1] for s in shards["down_proj"]) == full.shape[1]
    assert (shards["down_proj"][1] == full[:, i // tp : 2 * i // tp]).all()


def test_vocab_parallel_rows_follow_the_ranges():
    labels = d.draw_vocab_parallel([5, 3000, 17], 4096, 2).labels()
    assert labels[:3] == ["id 5\nrow 5", "id 3000\nzeros", "id 17\nrow 17"]
    assert labels[3:6] == ["id 5\nzeros", "id 3000\nrow 952", "id 17\nzeros"]
    three = d.draw_vocab_parallel([5, 3000], 4096, 4).labels()
    assert "id 3000\nrow 952" in three  # rank 2 holds rows 2048..3071: row 3000 - 2048


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_ring_all_reduce_states(p):
    states = d.ring_all_reduce_states(p)
    assert len(states) == 2 * (p - 1) + 1
    after_rs = states[p - 1]
    for r in range(p):  # reduce-scatter leaves rank r the whole sum of chunk r + 1
        assert after_rs[r][(r + 1) % p] == p
        assert sum(n == p for n in after_rs[r]) == 1
    assert all(n == p for row in states[-1] for n in row)
    # each step moves exactly one chunk per rank: p cells change
    for a, b in zip(states, states[1:], strict=False):
        assert (
            sum(x != y for ra, rb in zip(a, b, strict=False) for x, y in zip(ra, rb, strict=False))
            == p
        )


def test_ring_diagram_labels_are_the_states():
    c = d.draw_ring_all_reduce(4)
    labels = c.labels()
    states = d.ring_all_reduce_states(4)
    flat = [f"{'abcd'[ch]}{n}" for s in states for row in s for ch, n in enumerate(row)]
    assert labels == flat


def test_pipeline_schedule_and_stages():
    sched = d.pipeline_schedule(4, 8)
    assert all(len(row) == 11 for row in sched)
    assert all(sum(j is not None for j in row) == 8 for row in sched)
    assert sched[2][:3] == [None, None, 0] and sched[0][-1] is None
    labels = d.draw_pipeline(80, 4, (1, 8)).labels()
    assert labels.count("0") == 4 + 4 and labels.count("7") == 4
    lo, hi = stage_layers(80, 3, 4)
    c = d.draw_pipeline(80, 4, (8,))
    texts = [t.get_text() for t in c.ax.texts]
    assert f"stage 3: L{lo}–{hi - 1}" in texts and "8 micro-batches: bubble 27%" in texts
    odd = [t.get_text() for t in d.draw_pipeline(7, 2, (1,)).ax.texts]
    assert "stage 0: L0–3" in odd and "stage 1: L4–6" in odd


def test_expert_dispatch_places_experts_and_counts_crossings():
    routes = {0: (1, 6), 1: (2, 3), 2: (4, 5), 3: (0, 7)}
    c = d.draw_expert_dispatch(routes, 8, 2)
    labels = c.labels()
    assert labels[:2] == ["t0 → E1,E6", "t1 → E2,E3"]
    lo, hi = expert_range(8, 1, 2)
    assert labels[2:6] == [f"E{e}" for e in range(0, 4)]
    assert labels[-4:] == [f"E{e}" for e in range(lo, hi)]
    assert c.crossing == 2
    assert d.draw_expert_dispatch({0: (4, 5), 1: (6, 7), 2: (0, 1), 3: (2, 3)}, 8, 2).crossing == 8
