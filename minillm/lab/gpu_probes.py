"""Preflight and correctness probes for a GPU machine, before any benchmark runs.

`python -m minillm.lab.gpu_probes [--smoke] [--out DIR]`

- **Preflight**: CUDA is there (without it: one line, exit 2), the versions of torch,
  Triton and CUDA, and each package the test phases need, with a line per missing one
  saying what is skipped without it.
- **Probes**: each kernel once at a real serving size, in bfloat16 (float16 on GPUs
  without it) and float16, against a float64 PyTorch oracle: FlashAttention prefill
  (4 x 2048 tokens, 32 query and 8 KV heads of 128), split-KV paged decode (64 sequences
  of 4096 tokens), W4A16 and W8A16 at batch 1 and 16 (4096 x 4096). The CPU tests compute
  in float32 under Triton's interpreter, whose low-precision `tl.dot` is unreliable; these
  are the first runs of the bf16/fp16 paths.

`--smoke` runs the same code on a CPU under the interpreter, at small sizes and in float32:
it checks this script, not the GPU. Results go to `DIR/gpu_probes_<device>.json`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time

# what each phase of scripts/gpu_validate.sh needs, and what is skipped without it
NEEDED = {
    "triton": "every kernel",
    "numpy": "the benchmark and the tests",
    "pytest": "the test phases",
    "hypothesis": "the test phases (property tests)",
    "safetensors": "the engine tests (model loading)",
    "tokenizers": "the engine tests (the bundled tokenizer)",
    "transformers": "the model-logit oracle tests",
}

REAL = {
    "prefill": dict(batch=4, seq_len=2048, heads=32, kv_heads=8, head_dim=128),
    "decode": dict(batch=64, context=4096, heads=32, kv_heads=8, head_dim=128, block=16),
    "matmul": dict(ms=(1, 16), n=4096, k=4096, group=128),
}
SMOKE = {
    "prefill": dict(batch=2, seq_len=24, heads=4, kv_heads=2, head_dim=32),
    "decode": dict(batch=3, context=40, heads=4, kv_heads=2, head_dim=32, block=16),
    "matmul": dict(ms=(1, 5), n=64, k=256, group=128),
}
# largest error allowed against the float64 oracle, relative to the output's largest value
TOLERANCE = {"bfloat16": 2e-2, "float16": 4e-3, "float32": 1e-4}


def preflight(smoke: bool) -> dict:
    """Versions and packages; exits 2 with one line when there is no CUDA (unless smoke)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        print("gpu_probes needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        sys.exit(2)
    packages, missing = {}, []
    for name, needed_for in NEEDED.items():
        try:
            module = importlib.import_module(name)
            packages[name] = getattr(module, "__version__", "present")
        except Exception:  # an import that fails for any reason counts as missing
            packages[name] = None
            missing.append(f"{name} is missing: {needed_for} will be skipped (pip install {name})")
    for line in missing:
        print(line)
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "compute_capability": f"{props.major}.{props.minor}" if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "packages": packages,
        "missing": missing,
        "interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }


def _relative_error(actual, expected) -> float:
    expected = expected.double()
    scale = expected.abs().max().item() or 1.0
    return (actual.double() - expected).abs().max().item() / scale


def probe_prefill(device, dtype, size) -> dict:
    import torch

    from kernels.flash_attention import flash_attention, flash_attention_reference

    gen = torch.Generator(device="cpu").manual_seed(0)
    b, s, h, kvh, d = (size[k] for k in ("batch", "seq_len", "heads", "kv_heads", "head_dim"))
    q = torch.randn(b * s, h, d, generator=gen).to(device, dtype)
    k = torch.randn(b * s, kvh, d, generator=gen).to(device, dtype)
    v = torch.randn(b * s, kvh, d, generator=gen).to(device, dtype)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device=device)
    out = flash_attention(q, k, v, cu, s, d**-0.5)
    # the oracle on the first and last sequence only: a float64 score matrix per sequence
    errors = []
    for i in (0, b - 1):
        rows = slice(i * s, (i + 1) * s)
        one = torch.tensor([0, s], dtype=torch.int32, device=device)
        expected = flash_attention_reference(q[rows], k[rows], v[rows], one, d**-0.5)
        errors.append(_relative_error(out[rows], expected))
    return {"error": max(errors)}


def probe_decode(device, dtype, size) -> dict:
    import torch

    from kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

    gen = torch.Generator(device="cpu").manual_seed(1)
    b, ctx, h, kvh, d, bs = (
        size[k] for k in ("batch", "context", "heads", "kv_heads", "head_dim", "block")
    )
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq
    cache = torch.randn(2, num_blocks, bs, kvh, d, generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(b, per_seq).to(device, torch.int32)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    seq_lens[0] = max(1, ctx // 3)  # one shorter sequence: masked tail of its last split
    q = torch.randn(b, h, d, generator=gen).to(device, dtype)
    out = paged_decode_attention(q, cache, tables, seq_lens, d**-0.5, ctx)
    picked = [0, b - 1]
    expected = paged_decode_attention_reference(
        q[picked], cache, tables[picked], seq_lens[picked], d**-0.5
    )
    return {"error": _relative_error(out[picked], expected)}


def probe_matmul(device, dtype, size) -> dict:
    import torch

    from kernels.quant_matmul import (
        quantize_w4,
        quantize_w8,
        w4a16_matmul,
        w4a16_matmul_reference,
        w8a16_matmul,
        w8a16_matmul_reference,
    )

    gen = torch.Generator(device="cpu").manual_seed(2)
    n, k, group = size["n"], size["k"], size["group"]
    weight = (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)
    packed, scales4 = quantize_w4(weight, group)
    qweight, scales8 = quantize_w8(weight)
    errors = {}
    for m in size["ms"]:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        errors[f"w4a16_m{m}"] = _relative_error(
            w4a16_matmul(x, packed, scales4, group),
            w4a16_matmul_reference(x, packed, scales4, group),
        )
        errors[f"w8a16_m{m}"] = _relative_error(
            w8a16_matmul(x, qweight, scales8), w8a16_matmul_reference(x, qweight, scales8)
        )
    return {"error": max(errors.values()), "cases": errors}


PROBES = {"prefill": probe_prefill, "decode": probe_decode, "matmul": probe_matmul}


def run(smoke: bool) -> dict:
    import torch

    machine = preflight(smoke)
    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if smoke:
        dtypes = [torch.float32]
    else:
        low = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        dtypes = list(dict.fromkeys([low, torch.float16]))
    sizes = SMOKE if smoke else REAL
    results = {"machine": machine, "smoke": smoke, "probes": []}
    for name, probe in PROBES.items():
        for dtype in dtypes:
            dtype_name = str(dtype).removeprefix("torch.")
            entry = {"probe": name, "dtype": dtype_name, "size": sizes[name]}
            start = time.perf_counter()
            try:
                entry |= probe(device, dtype, sizes[name])
                entry["passed"] = entry["error"] <= TOLERANCE[dtype_name]
            except Exception as exc:  # one failing probe is recorded; the others still run
                entry |= {"passed": False, "exception": f"{type(exc).__name__}: {exc}"[:500]}
            entry["seconds"] = round(time.perf_counter() - start, 2)
            results["probes"].append(entry)
            print(
                f"{name:8s} {dtype_name:9s} "
                + ("passed" if entry["passed"] else "FAILED")
                + (f"  error {entry['error']:.2e}" if "error" in entry else "")
                + (f"  {entry['exception']}" if "exception" in entry else "")
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="on a CPU, small, float32")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    results = run(args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    from minillm.lab.kernel_bench import device_slug

    slug = "cpu" if args.smoke else device_slug(results["machine"]["gpu"])
    path = args.out / f"gpu_probes_{slug}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"results: {path}")
    return 0 if all(p["passed"] for p in results["probes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
