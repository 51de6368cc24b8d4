"""Train the bundled models on the Python standard library, with minillm's own model code.

    python -m minillm.training.train fit --model target --time-budget-s 2400 --threads 2
    python -m minillm.training.train fit --model draft --time-budget-s 600 --threads 2
    python -m minillm.training.train card        # measure both models, write README.md cards

`--init-from DIR` continues from the weights of an earlier run (same shape, same tokenizer)
under a fresh warmup + cosine schedule; the log, the step and token counts and the summary's
`stages` carry on from that run's.

`fit` prepares the corpus once (split, tokenizer, token streams) in `--work-dir`, trains
one model with AdamW under a warmup + cosine schedule, and writes a Hugging Face-format
directory: config.json, model.safetensors (bfloat16), tokenizer files, a loss log and a
loss-curve plot. Seeds are fixed; with `--max-steps` and no time budget two runs on the
same machine give the same weights.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from minillm.lab.recorded import weights_fingerprint
from minillm.model.config import ModelConfig
from minillm.model.llama import LlamaForCausalLM
from minillm.training import corpus
from minillm.training.model_card import stage_record

MODELS_DIR = pathlib.Path(__file__).parent.parent / "bundled"
DEFAULT_WORK_DIR = pathlib.Path.home() / ".cache" / "minillm" / "stdlib-corpus"
HELDOUT_FILE = "heldout_tokens.json"
SUMMARY_FILE = "training_summary.json"


@dataclass(slots=True)
class ModelSpec:
    """Shape and peak learning rate of one bundled model."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    learning_rate: float


SPECS = {
    "target": ModelSpec("minillm-stdlib-target", 256, 6, 8, 2, 768, 2e-3),
    "draft": ModelSpec("minillm-stdlib-draft", 128, 2, 4, 2, 384, 3e-3),
}


@dataclass(slots=True)
class TrainConfig:
    seq_len: int = 256
    batch_size: int = 16
    max_steps: int | None = None
    time_budget_s: float | None = None
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval_steps: int = 100
    log_interval_steps: int = 10
    seed: int = 0
    threads: int = 2
    bf16_autocast: bool = False  # bfloat16 matmuls (AMX, AVX512_BF16), fp32 weights


@dataclass(slots=True)
class CorpusData:
    tokenizer_path: pathlib.Path
    train_tokens: np.ndarray  # [num_train_tokens] uint16
    heldout: torch.Tensor  # [num_windows, seq_len + 1] int64, the fixed held-out slice
    manifest: dict


def model_config(spec: ModelSpec, tokenizer: Tokenizer) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.hidden_size // spec.num_attention_heads,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attention_bias=False,
        qk_norm=False,
        bos_token_id=tokenizer.token_to_id(corpus.BOS_TOKEN),
        eos_token_ids=[tokenizer.token_to_id(corpus.EOS_TOKEN)],
        torch_dtype="bfloat16",
    )


heldout_windows = corpus.spread_windows  # the held-out slice of the validation stream


def prepare_corpus(
    work_dir: pathlib.Path,
    seq_len: int,
    num_heldout_windows: int = 64,
    site_packages: bool = False,
    no_docstrings: bool = False,
):
    """Split the standard library, train the tokenizer, encode both splits; cached in work_dir.

    With `site_packages`, the installed packages' code (`corpus.read_site_packages`, which
    leaves out the foreign evaluation packages) joins the training split after the standard
    library's. With `no_docstrings`, the training split's text loses its docstrings
    (`corpus.without_docstrings`). Either way the tokenizer and the held-out split stay those
    of the standard library as it is.
    """
    manifest_path = work_dir / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        for key, wanted in [("site_packages", site_packages), ("no_docstrings", no_docstrings)]:
            if manifest.get(key, False) != wanted:
                raise ValueError(
                    f"{work_dir} holds a corpus built with {key}="
                    f"{manifest.get(key, False)}; use another --work-dir"
                )
    else:
        work_dir.mkdir(parents=True, exist_ok=True)
        documents = corpus.read_stdlib()
        train_docs, val_docs = corpus.split_documents(documents)
        tokenizer = corpus.train_tokenizer(train_docs)
        corpus.write_tokenizer_files(tokenizer, work_dir)
        val_tokens = corpus.encode_documents(tokenizer, val_docs)
        description = corpus.corpus_description()
        extra = {}
        if no_docstrings:
            stripped = [
                corpus.Document(d.path, corpus.without_docstrings(d.text)) for d in train_docs
            ]
            removed = sum(len(d.text.encode()) for d in train_docs)
            train_docs = stripped
            removed -= sum(len(d.text.encode()) for d in train_docs)
            description += ", docstrings removed"
            extra["num_docstring_bytes_removed"] = removed
        train_tokens = corpus.encode_documents(tokenizer, train_docs)
        if site_packages:
            site_docs = corpus.read_site_packages()
            site_tokens = corpus.encode_documents(tokenizer, site_docs)
            train_tokens = np.concatenate([train_tokens, site_tokens])
            site_root = corpus.site_packages_root()
            description += f" + {len(site_docs)} files of the installed packages ({site_root})"
            extra |= {
                "num_site_packages_files": len(site_docs),
                "num_site_packages_tokens": int(len(site_tokens)),
                "site_packages_files_per_package": corpus.files_per_package(site_docs),
            }
        np.save(work_dir / "train.npy", train_tokens)
        np.save(work_dir / "val.npy", val_tokens)
        manifest = {
            "corpus": description,
            "site_packages": site_packages,
            "no_docstrings": no_docstrings,
            **extra,
            "python_version": platform.python_version(),
            "num_files": len(documents),
            "num_train_files": len(train_docs),
            "num_validation_files": len(val_docs),
            "num_train_bytes": sum(len(d.text.encode()) for d in train_docs),
            "num_train_tokens": int(len(train_tokens)),
            "num_validation_tokens": int(len(val_tokens)),
            "validation_files": [d.path for d in val_docs],
        }
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    heldout = heldout_windows(np.load(work_dir / "val.npy"), num_heldout_windows, seq_len + 1)
    return CorpusData(
        tokenizer_path=work_dir / "tokenizer.json",
        train_tokens=np.load(work_dir / "train.npy"),
        heldout=torch.from_numpy(heldout),
        manifest=manifest,
    )


def init_weights(model: LlamaForCausalLM, num_layers: int) -> None:
    """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue  # RMSNorm weights stay at 1
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std /= math.sqrt(2 * num_layers)
        torch.nn.init.normal_(param, mean=0.0, std=std)


def learning_rate(step: int, progress: float, peak: float, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine from peak to min_lr_ratio * peak."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, heldout: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over heldout: [num_windows, seq_len + 1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for chunk in heldout.split(batch_size):
        logits = model.forward_causal(chunk[:, :-1])
        targets = chunk[:, 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
    model.train(was_training)
    return total / count


def cpu_model_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_earlier_run(
    model: LlamaForCausalLM, config: ModelConfig, data: CorpusData, run_dir: pathlib.Path
) -> dict:
    """Load the weights of the run in `run_dir` into `model`, to train on from them.

    The run must have this model's shape and this corpus's tokenizer. Returns its summary,
    with its log rows under "log_rows" and its weights' SHA-256 under "weights_sha256".
    """
    if (run_dir / "tokenizer.json").read_text() != data.tokenizer_path.read_text():
        raise ValueError(f"{run_dir} was trained with another tokenizer than this corpus's")
    written = json.loads((run_dir / "config.json").read_text())
    written.pop("pad_token_id", None)
    expected = json.loads(json.dumps(config.to_hf_config()))
    if written != expected:
        diff = sorted(
            k for k in expected.keys() | written.keys() if written.get(k) != expected.get(k)
        )
        raise ValueError(f"{run_dir} holds a model of another shape (differs in {diff})")
    state = {
        name: tensor.float() for name, tensor in load_file(run_dir / "model.safetensors").items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - allowed:
        raise ValueError(f"{run_dir}: missing {missing}, unexpected {unexpected} weights")
    summary = json.loads((run_dir / SUMMARY_FILE).read_text())
    summary["weights_sha256"] = weights_fingerprint(run_dir)
    with (run_dir / "training_log.csv").open() as f:
        summary["log_rows"] = list(csv.DictReader(f))
    return summary


def fit(
    spec: ModelSpec,
    cfg: TrainConfig,
    data: CorpusData,
    out_dir: pathlib.Path,
    init_from: pathlib.Path | None = None,
) -> dict:
    """Train one model and write its Hugging Face directory; returns the training summary.

    With `init_from`, training starts from that run's weights instead of a random init, and
    the log and the totals continue that run's.
    """
    if cfg.max_steps is None and cfg.time_budget_s is None:
        raise ValueError("give --max-steps, --time-budget-s, or both")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = Tokenizer.from_file(str(data.tokenizer_path))
    config = model_config(spec, tokenizer)
    model = LlamaForCausalLM(config)
    init_weights(model, spec.num_hidden_layers)
    earlier = load_earlier_run(model, config, data, init_from) if init_from else None
    params = list(model.parameters())  # tied embeddings appear once
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=spec.learning_rate,
        betas=(0.9, 0.95),
    )
    stream = torch.from_numpy(data.train_tokens.astype(np.int64))
    generator = torch.Generator().manual_seed(cfg.seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "training_log.csv"
    fields = ["step", "elapsed_s", "tokens_seen", "learning_rate", "train_loss", "heldout_loss"]
    log_file = log_path.open("w", newline="")
    log = csv.DictWriter(log_file, fieldnames=fields)
    log.writeheader()
    step0, tokens0, time0 = 0, 0, 0.0  # where the earlier run left off
    if earlier is not None:
        log.writerows(earlier["log_rows"])
        step0, tokens0, time0 = earlier["steps"], earlier["tokens_seen"], earlier["train_time_s"]

    step, tokens_seen, recent_losses = 0, 0, []
    start = time.perf_counter()
    while True:
        elapsed_s = time.perf_counter() - start
        progress = max(
            step / cfg.max_steps if cfg.max_steps else 0.0,
            elapsed_s / cfg.time_budget_s if cfg.time_budget_s else 0.0,
        )
        if progress >= 1.0:
            break
        lr = learning_rate(step, progress, spec.learning_rate, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(
            len(stream) - cfg.seq_len - 1, (cfg.batch_size,), generator=generator
        )
        batch = torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast):
            logits = model.forward_causal(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        step += 1
        tokens_seen += batch[:, 1:].numel()
        recent_losses.append(loss.item())
        if step % cfg.log_interval_steps == 0 or step % cfg.eval_interval_steps == 0:
            row = {
                "step": step0 + step,
                "elapsed_s": round(time0 + time.perf_counter() - start, 2),
                "tokens_seen": tokens0 + tokens_seen,
                "learning_rate": f"{lr:.6g}",
                "train_loss": round(sum(recent_losses) / len(recent_losses), 4),
                "heldout_loss": "",
            }
            if step % cfg.eval_interval_steps == 0:
                row["heldout_loss"] = round(heldout_loss(model, data.heldout), 4)
            log.writerow(row)
            log_file.flush()
            print(json.dumps(row), flush=True)
            recent_losses = []
    train_time_s = time.perf_counter() - start
    final_heldout = heldout_loss(model, data.heldout)
    log.writerow(
        {
            "step": step0 + step,
            "elapsed_s": round(time0 + train_time_s, 2),
            "tokens_seen": tokens0 + tokens_seen,
            "learning_rate": "",
            "train_loss": round(sum(recent_losses) / len(recent_losses), 4)
            if recent_losses
            else "",
            "heldout_loss": round(final_heldout, 4),
        }
    )
    log_file.close()

    save_model_dir(model, config, data, out_dir)
    plot_loss_curve(log_path, out_dir / "loss_curve.png", spec.name)
    stage = {
        "init_from_sha256": earlier["weights_sha256"] if earlier else None,
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_time_s": round(train_time_s, 1),
        "learning_rate": spec.learning_rate,
        "train_config": asdict(cfg),
    }
    stages = [stage]
    if earlier is not None:
        stages = earlier.get("stages", [stage_record(earlier)]) + stages
    summary = {
        "name": spec.name,
        "spec": asdict(spec),
        "train_config": asdict(cfg),
        "num_parameters": sum(p.numel() for p in params),
        "steps": step0 + step,
        "tokens_seen": tokens0 + tokens_seen,
        "train_time_s": round(time0 + train_time_s, 1),
        "tokens_per_s": round(tokens_seen / train_time_s, 1),  # this stage's
        "stages": stages,
        "heldout_loss_float32_weights": round(final_heldout, 4),
        "hardware": {"cpu": cpu_model_name(), "threads": cfg.threads},
        "software": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        },
        "corpus": {k: v for k, v in data.manifest.items() if k != "validation_files"},
    }
    (out_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def save_model_dir(
    model: LlamaForCausalLM, config: ModelConfig, data: CorpusData, out_dir: pathlib.Path
) -> None:
    """config.json, model.safetensors (bfloat16), tokenizer files, generation_config.json and
    the held-out slice, as a directory both transformers and minillm load."""
    tokenizer = Tokenizer.from_file(str(data.tokenizer_path))
    pad_id = tokenizer.token_to_id(corpus.PAD_TOKEN)
    hf_config = config.to_hf_config()
    hf_config["pad_token_id"] = pad_id
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    state = {
        name: tensor.detach().to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        # a tied lm_head is the embedding; transformers re-ties it on load
        if not (config.tie_word_embeddings and name == "lm_head.weight")
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    corpus.write_tokenizer_files(tokenizer, out_dir)
    generation_config = {
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_ids[0],
        "pad_token_id": pad_id,
        "do_sample": False,
        "max_new_tokens": 64,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    heldout = {
        "description": "fixed held-out slice: windows of the validation files' token stream",
        "validation_files": data.manifest["validation_files"],
        "token_ids": data.heldout.tolist(),
    }
    (out_dir / HELDOUT_FILE).write_text(json.dumps(heldout, separators=(",", ":")) + "\n")


def plot_loss_curve(log_path: pathlib.Path, png_path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with log_path.open() as f:
        rows = list(csv.DictReader(f))
    train = [(int(r["tokens_seen"]) / 1e6, float(r["train_loss"])) for r in rows if r["train_loss"]]
    held = [
        (int(r["tokens_seen"]) / 1e6, float(r["heldout_loss"])) for r in rows if r["heldout_loss"]
    ]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(*zip(*train, strict=True), label="train (mean over 10 steps)", linewidth=1)
    ax.plot(*zip(*held, strict=True), "o-", label="held-out", markersize=3)
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minillm.training.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fit_parser = sub.add_parser("fit", help="train the target and/or draft model")
    fit_parser.add_argument("--model", choices=["target", "draft", "both"], default="both")
    fit_parser.add_argument("--time-budget-s", type=float, default=None, help="per model")
    fit_parser.add_argument("--max-steps", type=int, default=None, help="per model")
    fit_parser.add_argument("--threads", type=int, default=2)
    fit_parser.add_argument("--seed", type=int, default=0)
    fit_parser.add_argument(
        "--bf16-autocast",
        action="store_true",
        help="bfloat16 matmuls, float32 weights: faster on CPUs with bfloat16 instructions "
        "(AMX or AVX512_BF16; 1.5x per step on one AMD EPYC core), slower on CPUs without "
        "them",
    )
    fit_parser.add_argument(
        "--site-packages",
        action="store_true",
        help="train also on the installed packages' code, except the foreign evaluation set",
    )
    fit_parser.add_argument(
        "--no-docstrings",
        action="store_true",
        help="train on the code with its docstrings cut out (the tokenizer and the held-out "
        "split keep them)",
    )
    fit_parser.add_argument(
        "--init-from",
        type=pathlib.Path,
        default=None,
        help="continue from the weights of an earlier run's directory (one --model only)",
    )
    fit_parser.add_argument(
        "--peak-lr", type=float, default=None, help="peak learning rate (default: the model's)"
    )
    fit_parser.add_argument("--out-dir", type=pathlib.Path, default=MODELS_DIR)
    fit_parser.add_argument("--work-dir", type=pathlib.Path, default=DEFAULT_WORK_DIR)
    card_parser = sub.add_parser("card", help="measure both models and write their cards")
    card_parser.add_argument("--out-dir", type=pathlib.Path, default=MODELS_DIR)
    card_parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    if args.command == "card":
        from minillm.training.model_card import write_cards

        torch.set_num_threads(args.threads)
        write_cards(args.out_dir / SPECS["target"].name, args.out_dir / SPECS["draft"].name)
        return
    if args.init_from is not None and args.model == "both":
        parser.error("--init-from continues one model: give --model target or --model draft")
    cfg = TrainConfig(
        max_steps=args.max_steps,
        time_budget_s=args.time_budget_s,
        seed=args.seed,
        threads=args.threads,
        bf16_autocast=args.bf16_autocast,
    )
    data = prepare_corpus(
        args.work_dir,
        cfg.seq_len,
        site_packages=args.site_packages,
        no_docstrings=args.no_docstrings,
    )
    print(f"corpus: {data.manifest['corpus']}, {len(data.train_tokens)} train tokens", flush=True)
    for which in ["target", "draft"] if args.model == "both" else [args.model]:
        spec = SPECS[which]
        if args.peak_lr is not None:
            spec = replace(spec, learning_rate=args.peak_lr)
        summary = fit(spec, cfg, data, args.out_dir / spec.name, init_from=args.init_from)
        print(json.dumps({k: summary[k] for k in ("name", "steps", "tokens_seen")}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
