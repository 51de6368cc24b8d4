"""The checks of chapter 6's exercises reject plausible wrong answers.

As for the other chapters: the solution's non-graded cells run in this process, then each
graded cell runs with the solution (it must pass), with the stub (NotImplementedError), and
with each wrong answer in the solution's place (it must fail with an AssertionError). Every
check meets plausible slips of the mechanism (a scale per tensor instead of per group, the
zero point's sign, the nibble order, forgetting the scales' bytes), and where it applies a
hard-coded answer, a right answer of the wrong type, and an answer that modifies its input.
"""

from __future__ import annotations

import math

import torch

from minillm.model.quantization.rtn import int4_spec, rtn

from .conftest import ROOT
from .exercise_checks import ExerciseChecks, FromNamespace

# -- exercises 1 and 2: per-group grids --------------------------------------------------


def grid(
    granularity="group",
    zero_sign=1,
    fp16=True,
    symmetric=False,
    codes_dtype=torch.int32,
    clobber=False,
):
    def quantize_groups(w, group_size, bits):
        n, k = w.shape
        q_max = 2**bits - 1
        size = {"group": group_size, "channel": k, "tensor": k}[granularity]
        groups = w.float().reshape(n, k // size, size)
        if granularity == "tensor":
            lo = groups.amin().clamp(max=0.0).expand(n, k // size)
            hi = groups.amax().clamp(min=0.0).expand(n, k // size)
        else:
            lo, hi = groups.amin(dim=2).clamp(max=0.0), groups.amax(dim=2).clamp(min=0.0)
        if symmetric:
            scales = (groups.abs().amax(dim=2) / (q_max // 2)).clamp(min=2**-14)
            zeros = torch.full_like(scales, (q_max + 1) // 2)
        else:
            scales = ((hi - lo) / q_max).clamp(min=2**-14)
            zeros = None
        if fp16:
            scales = scales.half().float()
        if zeros is None:
            zeros = (zero_sign * -lo / scales).round().clamp(0, q_max)
        reps = size
        s = scales.repeat_interleave(reps, dim=1)
        z = zeros.repeat_interleave(reps, dim=1)
        codes = (torch.round(w.float() / s) + z).clamp(0, q_max).to(codes_dtype)
        if granularity != "group":  # report the grid per group of the asked size, as asked
            scales = scales.repeat_interleave(size // group_size, dim=1)
            zeros = zeros.repeat_interleave(size // group_size, dim=1)
        if clobber:
            w[0, 0] = 0.0
        return codes, scales, zeros

    return quantize_groups


def dequant(kind):
    def dequantize_groups(codes, scales, zeros):
        g = codes.shape[1] // scales.shape[1]
        s = scales.float().repeat_interleave(g, dim=1)
        z = zeros.float().repeat_interleave(g, dim=1)
        if kind == "plus":
            return s * (codes.float() + z)
        if kind == "minus after":
            return s * codes.float() - z
        if kind == "first scale":
            return scales[:, :1].float() * (codes.float() - z)
        if kind == "in place":
            codes -= z.to(codes.dtype)
            return s * codes.float()
        return (s * (codes.float() - z)).double()

    return dequantize_groups


# -- exercise 3: GPTQ packing -------------------------------------------------------------


def packer(order=range(8), along="k", dtype=torch.int32, clobber=False):
    order = list(order)

    def pack_gptq(q):
        n, k = q.shape
        if along == "n":  # eight output channels per word: [K, N / 8], N padded to a multiple of 8
            pad = torch.zeros(-n % 8, k, dtype=torch.int64)
            v = torch.cat([q.to(torch.int64), pad]).T.reshape(k, -1, 8)
            words = (v << (4 * torch.arange(8))).sum(dim=2)
        else:
            v = q.to(torch.int64).T.reshape(k // 8, 8, n)[:, order, :]
            words = (v << (4 * torch.arange(8)).view(1, 8, 1)).sum(dim=1)
        if clobber:
            q[0, 0] = 0
        if dtype == torch.int64:
            return words
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    return pack_gptq


def unpacker(order=range(8), transpose=True):
    order = list(order)

    def unpack_gptq(qweight):
        k8, n = qweight.shape
        nibbles = (qweight.to(torch.int64)[:, None, :] >> (4 * torch.arange(8)).view(1, 8, 1)) & 0xF
        nibbles = nibbles[:, order, :]
        out = nibbles.reshape(k8 * 8, n)
        return (out.T.contiguous() if transpose else out).to(torch.int32)

    return unpack_gptq


# -- exercise 4: GPTQ with each group's grid chosen on arrival ----------------------------


def gptq_with(rule):
    """A wrong gptq_dynamic, built on the notebook's own quantize_groups."""

    def factory(namespace):
        quantize_groups = namespace["quantize_groups"]

        def gptq_dynamic(w, H, group_size):
            n, k = w.shape
            H = H.clone()
            if rule != "no dampening":
                H.diagonal().add_(0.01 * H.diagonal().mean())
            inverse = (
                H
                if rule == "feedback weighted by H"
                else torch.cholesky_inverse(torch.linalg.cholesky(H))
            )
            U = torch.linalg.cholesky(inverse, upper=True)
            W = w if rule == "modifies w" else w.clone()
            codes = torch.zeros(n, k, dtype=torch.int32)
            scales, zeros = [], []
            for i in range(k):
                if i % group_size == 0:
                    source = w if rule == "static groups" else W
                    _, s_g, z_g = quantize_groups(source[:, i : i + group_size], group_size, 4)
                    scales.append(s_g)
                    zeros.append(z_g)
                    s, z = s_g[:, 0].double(), z_g[:, 0].double()
                q = (torch.round(W[:, i] / s) + z).clamp(0, 15)
                codes[:, i] = q.to(torch.int32)
                err = W[:, i] - s * (q - z)
                if rule != "error not divided by U_ii":
                    err = err / U[i, i]
                if rule == "no error feedback":
                    continue
                W[:, i + 1 :] -= err[:, None] * U[i, i + 1 :][None, :]
            out = codes, torch.cat(scales, dim=1), torch.cat(zeros, dim=1)
            return list(out) if rule == "a list" else out

        return gptq_dynamic

    return FromNamespace(factory)


# -- exercise 5: FP8 scale ----------------------------------------------------------------


def fp8(top=448.0, signed_max=False, as_tensor=False, clobber=False):
    def fp8_quantize(x, amax=None):
        if amax is None:
            amax = float(x.max() if signed_max else x.abs().max()) if x.numel() else 0.0
        scale = amax / top if amax > 0 else 1.0
        codes = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        if clobber:
            x.div_(scale)
        return (torch.tensor(scale) if as_tensor else scale), codes

    return fp8_quantize


def fp8_inverted(x, amax=None):
    amax = float(x.abs().max()) if amax is None else amax
    scale = 448.0 / amax if amax > 0 else 1.0
    return scale, (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)


# -- exercise 6: a format from its bits ---------------------------------------------------


def fmt_props(u_bits=1, bias_offset=-1, max_rule=None, as_tuple=False):
    def format_properties(exponent_bits, mantissa_bits, special):
        e, m = exponent_bits, mantissa_bits
        bias = 2 ** (e - 1) + bias_offset
        top = 2**e - 1
        rule = max_rule or special
        if rule == "ieee":
            largest = (2 - 2.0**-m) * 2.0 ** (top - 1 - bias)
        elif rule == "fn":
            largest = (2 - 2.0 ** (1 - m)) * 2.0 ** (top - bias)
        else:
            largest = (2 - 2.0**-m) * 2.0 ** (top - bias)
        out = {
            "unit_roundoff": 2.0 ** -(m + u_bits),
            "max": largest,
            "min_normal": 2.0 ** (1 - bias),
            "min_subnormal": 2.0 ** (1 - bias - m),
        }
        return tuple(out.values()) if as_tuple else out

    return format_properties


# -- exercise 7: bytes of a quantized model -----------------------------------------------


def model_bytes(
    scales=True, zero_unit=8, embed_bits=None, per_channel=False, tied=False, constant=None
):
    def quantized_bytes(config, bits, group_size, scale_bytes, zero_bits):
        if constant is not None:
            return constant
        h, d = config.hidden_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        inter = config.intermediate_size
        shapes = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
        linear = sum(n * k for n, k in shapes)
        num_groups = sum(n for n, k in shapes) if per_channel else linear / group_size
        per_group = (scale_bytes if scales else 0) + zero_bits / zero_unit
        layers = config.num_hidden_layers
        quantized = layers * (linear * bits / 8 + num_groups * per_group)
        tables = config.vocab_size * h * (1 if (tied or config.tie_word_embeddings) else 2)
        table_bytes = tables * (embed_bits / 8 if embed_bits else 2)
        return quantized + table_bytes + 2 * (2 * layers + 1) * h

    return quantized_bytes


# -- exercise 8: the W4A16 batch ----------------------------------------------------------


def w4_batch(rule):
    def w4a16_no_gain_batch(n, k, peak_flops, bandwidth, group_size):
        if rule == "ridge":
            return math.ceil(peak_flops / bandwidth)
        if rule == "hard-coded":
            return 326

        def floor(m, weight_bytes, acts=True):
            act = 2 * (m * k + m * n) if acts else 0
            return max(2 * m * n * k / peak_flops, (act + weight_bytes) / bandwidth)

        w16, w4 = 2 * n * k, n * k / 2 + 2 * n * k / group_size
        m = 1
        if rule == "w4 compute-bound":
            while floor(m, w4) > 2 * m * n * k / peak_flops:
                m += 1
            return m
        if rule == "no activations":
            while floor(m, w4, False) < floor(m, w16, False):
                m += 1
            return m
        while floor(m, w4) < floor(m, w16):
            m += 1
        return float(m)

    return w4a16_no_gain_batch


# -- exercise 10: perplexity ----------------------------------------------------------------


def ppl(kind):
    def perplexity_from_logits(logits, token_ids):
        shift = token_ids[:, :-1] if kind == "off by one" else token_ids[:, 1:]
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), shift.flatten(), reduction="none"
        )
        if kind == "mean of exp":
            return float(ce.exp().mean())
        if kind == "bits":
            return 2.0 ** float(ce.mean())
        if kind == "tensor":
            return ce.mean().exp()
        return math.exp(float(ce.mean()))

    return perplexity_from_logits


# -- exercise 11: the measurement -----------------------------------------------------------


def measuring(kind):
    def factory(ns):
        def measure(quantization, num_windows):
            from minillm.llm import LLM

            q = None if kind == "ignores quantization" else quantization
            llm = LLM(
                ns["DEFAULT_MODEL"],
                dtype="float32",
                device="cpu",
                num_gpu_blocks=64,
                quantization=q,
            )
            model = llm.engine.model_runner.model
            count = 1 if kind == "first window" else num_windows
            windows = ns["heldout_windows"](ns["bundled"].path)[:count]
            nbytes = ns["weight_bytes"](ns["bundled"].model if kind == "float bytes" else model)
            return ns["perplexity"](model, windows), nbytes

        return measure

    return FromNamespace(factory)


# -- exercise 12: the Pareto front --------------------------------------------------------


def front(kind):
    def pareto_front(points):
        if kind == "best per size":
            best = {}
            for name, (b, p) in points.items():
                if b not in best or p < points[best[b]][1]:
                    best[b] = name
            return sorted(best.values(), key=lambda n: (points[n][0], n))
        out = []
        for name, (b, p) in points.items():
            others = [v for o, v in points.items() if o != name]
            if kind == "equal dominates":
                dominated = any(b2 <= b and p2 <= p for b2, p2 in others)
            else:
                dominated = any(b2 <= b and p2 <= p and (b2, p2) != (b, p) for b2, p2 in others)
            if not dominated:
                out.append(name)
        if kind == "modifies":
            for name in list(points):
                if name not in out:
                    points.pop(name)
        if kind == "by perplexity":
            return sorted(out, key=lambda n: (points[n][1], n))
        ordered = sorted(out, key=lambda n: (points[n][0], n))
        return set(ordered) if kind == "a set" else ordered

    return pareto_front


# -- exercise 13: a W4A16 kernel (the wrong answers in PyTorch: the check sees only y) -----


def w4a16_with(rule):
    def w4a16_matmul(x, qweight, scales, zeros, group_size):
        words = qweight.to(torch.int64)
        if rule != "no mask after a signed shift":
            words = words % 2**32
        order = torch.arange(8) if rule != "nibbles in reverse order" else torch.arange(7, -1, -1)
        q = words[:, None, :] >> (4 * order)[None, :, None]
        if rule != "no mask after a signed shift":
            q = q & 0xF
        q = q.reshape(-1, qweight.shape[1]).T.float()  # [N, K]
        k = q.shape[1]
        g = torch.arange(k) // (8 if rule == "group of each packed word" else group_size)
        g = g.clamp(max=scales.shape[1] - 1)
        z = torch.full_like(q, 8.0) if rule == "symmetric: zero point 8" else zeros[:, g]
        w_hat = scales[:, g] * (q + z if rule == "zero point added" else q - z)
        if rule == "modifies x":
            x.mul_(1.0)
            x[0, 0] += 1.0
        y = x @ w_hat.T
        return y.T.contiguous() if rule == "[N, M]" else y

    return w4a16_matmul


# -- exercise 14: AWQ's scale search ------------------------------------------------------


def awq_with(rule):
    def awq_scale_search(x, w, quantize, alphas):
        if rule == "modifies x":
            x.abs_()
        x, w = x.float(), w.float()
        exact = x @ w.T
        if rule == "max instead of mean":
            stat = x.abs().amax(dim=0)
        elif rule == "per output channel":
            stat = exact.abs().mean(dim=0)  # [N]: one factor per output channel
        else:
            stat = x.abs().mean(dim=0)
        stat = stat.clamp(min=1e-4)
        grid = [0.5] if rule == "alpha fixed at 0.5" else alphas
        best = None
        for alpha in grid:
            s = stat.pow(alpha)
            s = s / (s.max() * s.min()).sqrt()
            if rule == "per output channel":  # rows of W scaled, the outputs divided back
                y_hat = x @ (quantize(w * s[:, None]) / s[:, None]).T
                s = torch.ones(w.shape[1])
            elif rule == "weights scaled, activations not divided":
                y_hat = x @ quantize(w * s).T
            else:
                y_hat = (x / s) @ quantize(w * s).T
            if rule == "error on the weights":
                error = float(((w - quantize(w * s) / s) ** 2).sum())
            elif rule == "own quantizer":  # per channel, 4 bits: not the Q given
                ws = w * s
                step = ws.abs().amax(dim=1, keepdim=True) / 7
                error = float(((exact - (x / s) @ (torch.round(ws / step) * step).T) ** 2).sum())
            else:
                error = float(((exact - y_hat) ** 2).sum())
            if best is None or error < best[0]:
                best = (error, float(alpha), s)
        if rule == "alpha as a tensor":
            return torch.tensor(best[1]), best[2]
        if rule == "hard-coded alpha 0.4":
            return 0.4, best[2]
        return best[1], best[2]

    return awq_scale_search


WRONG_ANSWERS = {
    "quantize_groups": {
        "a scale per tensor": grid("tensor"),
        "a scale per channel": grid("channel"),
        "zero point sign": grid(zero_sign=-1),
        "scales not rounded to float16": grid(fp16=False),
        "symmetric grid": grid(symmetric=True),
        "float codes": grid(codes_dtype=torch.float32),
        "modifies w": grid(clobber=True),
        "hard-coded": FromNamespace(lambda ns: lambda w, g, b: rtn(ns["down"], int4_spec(128))),
    },
    "dequantize_groups": {
        "s (q + z)": dequant("plus"),
        "s q - z": dequant("minus after"),
        "one scale per row": dequant("first scale"),
        "float64": dequant("float64"),
        "modifies codes": dequant("in place"),
    },
    "pack_gptq": {
        "highest nibble first": packer(order=range(7, -1, -1)),
        "packed along the output dim": packer(along="n"),
        "int64 words": packer(dtype=torch.int64),
        "modifies q": packer(clobber=True),
    },
    "unpack_gptq": {
        "highest nibble first": unpacker(order=range(7, -1, -1)),
        "[K, N], not transposed back": unpacker(transpose=False),
    },
    "gptq_dynamic": {
        "static groups (grid from the original w)": gptq_with("static groups"),
        "no error feedback (round to nearest)": gptq_with("no error feedback"),
        "no dampening": gptq_with("no dampening"),
        "feedback weighted by H, not its inverse": gptq_with("feedback weighted by H"),
        "error not divided by U_ii": gptq_with("error not divided by U_ii"),
        "modifies w": gptq_with("modifies w"),
        "a list": gptq_with("a list"),
    },
    "fp8_quantize": {
        "scale for 240 (fnuz)": fp8(top=240.0),
        "scale inverted": fp8_inverted,
        "signed max": fp8(signed_max=True),
        "a tensor scale": fp8(as_tensor=True),
        "modifies x": fp8(clobber=True),
    },
    "format_properties": {
        "epsilon for unit roundoff": fmt_props(u_bits=0),
        "bias 2^(e-1)": fmt_props(bias_offset=0),
        "ieee max for every format": fmt_props(max_rule="ieee"),
        "fn max for every format": fmt_props(max_rule="fn"),
        "a tuple": fmt_props(as_tuple=True),
    },
    "quantized_bytes": {
        "forgets the scales' bytes": model_bytes(scales=False),
        "zero points in bytes": model_bytes(zero_unit=1),
        "quantizes the embedding too": model_bytes(embed_bits=4),
        "one scale per channel": model_bytes(per_channel=True),
        "assumes tied tables": model_bytes(tied=True),
        "hard-coded": model_bytes(constant=39_767_785_472),
    },
    "w4a16_no_gain_batch": {
        "where W4A16 is compute-bound": w4_batch("w4 compute-bound"),
        "the ridge point": w4_batch("ridge"),
        "ignores activation bytes": w4_batch("no activations"),
        "a float": w4_batch("float"),
        "hard-coded": w4_batch("hard-coded"),
    },
    "smooth_scales": {
        "exponents swapped": lambda a, w, alpha: (
            a.clamp(min=1e-5).pow(1 - alpha) / w.clamp(min=1e-5).pow(alpha)
        ),
        "a product": lambda a, w, alpha: (
            a.clamp(min=1e-5).pow(alpha) * w.clamp(min=1e-5).pow(1 - alpha)
        ),
        "inverted": lambda a, w, alpha: (
            w.clamp(min=1e-5).pow(1 - alpha) / a.clamp(min=1e-5).pow(alpha)
        ),
        "no clamp": lambda a, w, alpha: a.float().pow(alpha) / w.float().pow(1 - alpha),
    },
    "perplexity_from_logits": {
        "mean of exp": ppl("mean of exp"),
        "2 ** nats": ppl("bits"),
        "off by one": ppl("off by one"),
        "a tensor": ppl("tensor"),
    },
    "measure": {
        "ignores quantization": measuring("ignores quantization"),
        "first window only": measuring("first window"),
        "the float model's bytes": measuring("float bytes"),
    },
    "pareto_front": {
        "equal points dominate": front("equal dominates"),
        "best per size": front("best per size"),
        "sorted by perplexity": front("by perplexity"),
        "a set": front("a set"),
        "modifies points": front("modifies"),
    },
    "w4a16_matmul": {
        "symmetric: zero point 8": w4a16_with("symmetric: zero point 8"),
        "zero point added": w4a16_with("zero point added"),
        "nibbles in reverse order": w4a16_with("nibbles in reverse order"),
        "no mask after a signed shift": w4a16_with("no mask after a signed shift"),
        "group of each packed word": w4a16_with("group of each packed word"),
        "[N, M]": w4a16_with("[N, M]"),
        "modifies x": w4a16_with("modifies x"),
    },
    "awq_scale_search": {
        label: awq_with(label)
        for label in (
            "weights scaled, activations not divided",
            "alpha fixed at 0.5",
            "per output channel",
            "error on the weights",
            "max instead of mean",
            "own quantizer",
            "alpha as a tensor",
            "hard-coded alpha 0.4",
            "modifies x",
        )
    },
}


class TestChecks(ExerciseChecks):
    SOLUTION = ROOT / "solutions" / "ch06_quantization.ipynb"
    EXERCISE = ROOT / "exercises" / "ch06_quantization.ipynb"
    POINTS = [3, 2, 3, 5, 3, 3, 3, 3, 2, 2, 3, 2, 5, 4]
    WRONG_ANSWERS = WRONG_ANSWERS
