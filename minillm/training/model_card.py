"""Measure the bundled models and write their model cards from the measurements.

Every number in a card comes from `training_summary.json` beside it: the training run
writes its part (steps, tokens seen, time, hardware), and `measure` adds held-out loss,
sample completions and, for the draft, how often it agrees with the target. It also
measures the model on Python it never saw: loss on code from packages outside the standard
library, and whether greedy completions of ten function headers parse. All measurements
use the shipped bfloat16 weights upcast to float32, the way tests load them.
"""

from __future__ import annotations

import ast
import json
import math
import pathlib

import torch
import torch.nn.functional as F

from minillm.model.llama import LlamaForCausalLM
from minillm.model.loader import load_model
from minillm.model.tokenizer import Tokenizer
from minillm.training.corpus import (
    FOREIGN_EXCLUDED,
    FOREIGN_FRACTION,
    FOREIGN_PACKAGES,
    SITE_MAX_FILE_BYTES,
    build_foreign_set,
    installed_package,
)

SUMMARY_FILE = "training_summary.json"
HELDOUT_FILE = "heldout_tokens.json"
FOREIGN_FILE = "foreign_tokens.json"
# Headers of ordinary functions and methods, written for this evaluation. A method's prompt
# starts with its class line, so header and body parse as they stand, without dedenting.
HEADERS = [
    "def parse_config(path):",
    "def merge_sorted(a, b):",
    "def count_words(text):",
    "def clamp(value, low, high):",
    "def chunked(items, size):",
    "def read_json(filename):",
    "def is_palindrome(word):",
    "def flatten(nested):",
    "class Inventory:\n    def add_item(self, name, quantity):",
    "class Cache:\n    def get(self, key, default=None):",
]
HEADER_NEW_TOKENS = 96
SAMPLE_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:",
    "import os\n",
    "for i in range(",
    'if __name__ == "__main__":',
]
# Prompts for the draft/target agreement: the samples plus a few more everyday openings.
ACCEPTANCE_PROMPTS = SAMPLE_PROMPTS + [
    "def __init__(self, ",
    "    def __repr__(self):\n",
    "import sys\n\n\ndef main(",
    "try:\n    import ",
    "with open(path) as f:\n",
]
SAMPLE_NEW_TOKENS = 48
ACCEPTANCE_NEW_TOKENS = 64
DRAFT_LENGTH = 4  # k: tokens the draft proposes per speculative step


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, token_ids: torch.Tensor, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy in nats over token_ids: [num_windows, window_len]."""
    total, count = 0.0, 0
    for chunk in token_ids.split(batch_size):
        logits = model.forward_causal(chunk[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
        count += chunk[:, 1:].numel()
    return float(total) / count


@torch.no_grad()
def greedy_generate(
    model: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, eos_id: int | None
) -> list[int]:
    """Argmax decoding with the cache-free forward; returns the new tokens (EOS included)."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        next_id = int(model.forward_causal(torch.tensor([ids]))[0, -1].argmax())
        ids.append(next_id)
        if next_id == eos_id:
            break
    return ids[len(prompt_ids) :]


@torch.no_grad()
def draft_agreement(
    draft: LlamaForCausalLM, prompt_ids: list[int], target_new_ids: list[int]
) -> tuple[int, list[int]]:
    """Compare the draft with the target's greedy continuation `target_new_ids`.

    Returns (positions where the draft's argmax equals the target's token, accepted draft
    tokens per round of greedy speculative decoding with k = DRAFT_LENGTH). In greedy
    speculative decoding (Leviathan et al., 2023) a round accepts the draft's proposals up
    to the first one that differs from the target's argmax, then takes the target's token.
    """
    ids = prompt_ids + target_new_ids
    logits = draft.forward_causal(torch.tensor([ids]))[0, len(prompt_ids) - 1 : -1]
    matches = int((logits.argmax(-1) == torch.tensor(target_new_ids)).sum())
    accepted_per_round = []
    pos = 0
    while pos < len(target_new_ids):
        proposal = greedy_generate(draft, ids[: len(prompt_ids) + pos], DRAFT_LENGTH, None)
        expected = target_new_ids[pos : pos + DRAFT_LENGTH]
        accepted = 0
        while accepted < len(expected) and proposal[accepted] == expected[accepted]:
            accepted += 1
        accepted_per_round.append(accepted)
        pos += accepted + 1  # the target's own token ends every round
    return matches, accepted_per_round


def header_body(header: str, completion: str, stopped_at_eos: bool) -> tuple[str, str]:
    """The body a completion gives `header`, and why it ends: "eos", "dedent" or "limit".

    The body runs to the first non-empty line indented at or below the header's own line
    (the model has moved on to other code), or to EOS. When the token limit stopped the
    completion instead, its last line may be cut mid-statement, so it is dropped.
    """
    last_line = header.split("\n")[-1]
    indent = len(last_line) - len(last_line.lstrip())
    first, *rest = completion.split("\n")
    body_lines, stop = [], "eos" if stopped_at_eos else "limit"
    for line in rest:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            stop = "dedent"
            break
        body_lines.append(line)
    if stop == "limit":
        if body_lines:
            body_lines.pop()
        else:
            first = ""  # the completion never left the header's line
    return "\n".join([first, *body_lines]), stop


def parses(source: str) -> bool:
    """Whether `ast.parse` accepts `source`."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):  # ValueError: a null byte in the source
        return False
    return True


def complete_headers(model: LlamaForCausalLM, tokenizer, eos_id: int | None) -> list[dict]:
    """Greedy completion of each of HEADERS, its body, and whether header + body parses."""
    results = []
    for header in HEADERS:
        new_ids = greedy_generate(model, tokenizer.encode(header), HEADER_NEW_TOKENS, eos_id)
        stopped_at_eos = bool(new_ids) and new_ids[-1] == eos_id
        completion = tokenizer.decode(new_ids[:-1] if stopped_at_eos else new_ids)
        body, stop = header_body(header, completion, stopped_at_eos)
        results.append(
            {
                "header": header,
                "completion": completion,
                "body": body,
                "stop": stop,
                "parses": parses(header + body),
            }
        )
    return results


def write_foreign_set(model_dir: pathlib.Path, window_len: int, num_windows: int = 64) -> None:
    """Store the foreign-code windows beside the held-out ones, from the installed packages."""
    sources = [installed_package(n, m) for n, m in FOREIGN_PACKAGES.items()]
    backend = Tokenizer(model_dir).backend
    foreign = build_foreign_set(backend, sources, num_windows, window_len)
    (model_dir / FOREIGN_FILE).write_text(json.dumps(foreign, separators=(",", ":")) + "\n")


def draft_acceptance(draft: LlamaForCausalLM, target: LlamaForCausalLM, tokenizer, eos_id) -> dict:
    """How often the draft's greedy token equals the target's, over the target's own greedy
    continuations of ACCEPTANCE_PROMPTS, and the tokens per verification round at
    DRAFT_LENGTH drafts that this gives (`draft_agreement`)."""
    matches, positions, rounds = 0, 0, []
    for prompt in ACCEPTANCE_PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        target_new = greedy_generate(target, prompt_ids, ACCEPTANCE_NEW_TOKENS, eos_id)
        m, accepted = draft_agreement(draft, prompt_ids, target_new)
        matches, positions, rounds = matches + m, positions + len(target_new), rounds + accepted
    return {
        "num_prompts": len(ACCEPTANCE_PROMPTS),
        "num_positions": positions,
        "greedy_acceptance_rate": round(matches / positions, 4),
        "draft_length": DRAFT_LENGTH,
        "mean_accepted_per_round": round(sum(rounds) / len(rounds), 3),
        "mean_tokens_per_round": round(sum(rounds) / len(rounds) + 1, 3),
    }


def measure(model_dir: pathlib.Path, target_dir: pathlib.Path | None = None) -> dict:
    """Held-out loss and samples of one model; agreement with the target if target_dir."""
    loaded = load_model(model_dir, dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    eos_id = tokenizer.eos_token_id
    heldout = json.loads((model_dir / HELDOUT_FILE).read_text())["token_ids"]
    loss = heldout_loss(model, torch.tensor(heldout))
    samples = []
    for prompt in SAMPLE_PROMPTS:
        new_ids = greedy_generate(model, tokenizer.encode(prompt), SAMPLE_NEW_TOKENS, eos_id)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(new_ids)})
    result = {
        "weights": "bfloat16, upcast to float32",
        "heldout_num_windows": len(heldout),
        "heldout_num_predicted_tokens": len(heldout) * (len(heldout[0]) - 1),
        "heldout_loss": round(loss, 4),
        "heldout_perplexity": round(math.exp(loss), 2),
        "samples": samples,
    }
    foreign_path = model_dir / FOREIGN_FILE
    if foreign_path.exists():
        foreign = json.loads(foreign_path.read_text())
        foreign_loss = heldout_loss(model, torch.tensor(foreign["token_ids"]))
        headers = complete_headers(model, tokenizer, eos_id)
        result |= {
            "foreign_num_windows": len(foreign["token_ids"]),
            "foreign_num_predicted_tokens": len(foreign["token_ids"])
            * (len(foreign["token_ids"][0]) - 1),
            "foreign_loss": round(foreign_loss, 4),
            "foreign_perplexity": round(math.exp(foreign_loss), 2),
            "foreign_sources": foreign["sources"],
            "foreign_num_files": len(foreign["files"]),
            "headers_parsed": sum(h["parses"] for h in headers),
            "headers": headers,
        }
    if target_dir is not None:
        target = load_model(target_dir, dtype="float32").model
        result["acceptance"] = draft_acceptance(model, target, tokenizer, eos_id)
    return result


def _docstring_lines(corpus: dict) -> list[str]:
    """What a corpus built with `--no-docstrings` left out, and why."""
    if not corpus.get("no_docstrings"):
        return []
    removed = corpus["num_docstring_bytes_removed"]
    return [
        "The training text has no docstrings: `minillm.training.corpus.without_docstrings` "
        "cuts out the docstring of every module, class and function, "
        f"{removed / 1e6:.1f} MB of the split's {(corpus['num_train_bytes'] + removed) / 1e6:.1f} "
        "MB (the sizes above are after the cut), and puts `pass` where a body held nothing "
        "else. Comments stay. A model this small does not learn English prose in a CPU-hour, "
        "and under greedy decoding it loops inside a docstring until the token limit "
        '("Return a list of the list of the list of ..."); without them, a function header is '
        "followed by code. The tokenizer is trained on the split with its docstrings, and the "
        "evaluations below keep theirs, so their perplexities include text of a kind the "
        "model was not trained on.",
        "",
    ]


def _site_packages_lines(corpus: dict) -> list[str]:
    """The training data's second part, for a corpus built with `--site-packages`."""
    if not corpus.get("site_packages"):
        return []
    per_package = corpus["site_packages_files_per_package"]
    largest = ", ".join(f"{name} ({count:,})" for name, count in list(per_package.items())[:12])
    return [
        f"After it come {corpus['num_site_packages_files']:,} `.py` files, "
        f"{corpus['num_site_packages_tokens'] / 1e6:.2f}M tokens, of the {len(per_package)} "
        "top-level packages and modules installed in minillm's environment by `make install` "
        f"(its pinned dependencies and theirs), most files from {largest}. Each is distributed "
        "under its own license. Left out: every file of the packages the foreign evaluation "
        "below uses, with the copies other packages vendor and their metadata directories, so "
        "that evaluation stays code the model never saw; files over "
        f"{SITE_MAX_FILE_BYTES // 1000} KB (generated tables); files that are not UTF-8.",
        "",
    ]


def stage_record(summary: dict) -> dict:
    """One stage of a summary that predates `stages`: the run as a single stage."""
    return {
        "init_from_sha256": None,
        "steps": summary["steps"],
        "tokens_seen": summary["tokens_seen"],
        "train_time_s": summary["train_time_s"],
        "learning_rate": summary["spec"]["learning_rate"],
        "train_config": summary["train_config"],
    }


def _fit_commands(summary: dict, role: str, flags: str) -> list[str]:
    """The `fit` command of each training stage; a later stage continues the one before."""
    stages = summary.get("stages") or [stage_record(summary)]
    commands = []
    for number, stage in enumerate(stages, 1):
        cfg = stage["train_config"]
        budget = f" --time-budget-s {cfg['time_budget_s']:g}" if cfg["time_budget_s"] else ""
        steps = f" --max-steps {cfg['max_steps']}" if cfg["max_steps"] else ""
        autocast = " --bf16-autocast" if cfg.get("bf16_autocast") else ""
        extra = ""
        if number > 1:
            extra = (
                f" --init-from stage{number - 1}/{summary['name']} "
                f"--peak-lr {stage['learning_rate']:g}"
            )
        out = f" --out-dir stage{number}" if number < len(stages) else ""
        commands.append(
            f"python -m minillm.training.train fit --model {role}{budget}{steps}{autocast}{flags}"
            f" --threads {cfg['threads']} --seed {cfg['seed']}{extra}{out}"
        )
    return commands


def _schedule_rows(summary: dict) -> list[str]:
    """The time, steps, schedule and seed rows of the training table, one run or several."""
    spec, cfg = summary["spec"], summary["train_config"]
    stages = summary.get("stages") or [stage_record(summary)]
    batch = f"of {cfg['batch_size']} x {cfg['seq_len']} tokens"
    if len(stages) == 1:
        return [
            f"| wall-clock time | {summary['train_time_s'] / 60:.1f} min |",
            f"| steps | {summary['steps']:,} {batch} |",
            f"| schedule | peak learning rate {spec['learning_rate']:g}, "
            f"{cfg['warmup_steps']} warmup steps, cosine to {cfg['min_lr_ratio']:g} x peak "
            "over the budget |",
            f"| seed | {cfg['seed']} |",
        ]
    minutes = " + ".join(f"{s['train_time_s'] / 60:.1f}" for s in stages)
    steps = " + ".join(f"{s['steps']:,}" for s in stages)
    peaks = ", ".join(f"{s['learning_rate']:g}" for s in stages)
    seeds = ", ".join(str(s["train_config"]["seed"]) for s in stages)
    return [
        f"| wall-clock time | {summary['train_time_s'] / 60:.1f} min ({minutes}) |",
        f"| steps | {summary['steps']:,} ({steps}) {batch} |",
        f"| schedule | {len(stages)} stages, each starting from the weights the one before "
        "ended with (AdamW's moments start again at zero); each has "
        f"{cfg['warmup_steps']} warmup steps, then cosine to {cfg['min_lr_ratio']:g} x its "
        f"peak over its budget; peak learning rates {peaks} |",
        f"| seed | {seeds} (the batch order of each stage) |",
    ]


def _first_body_line(body: str, width: int = 60) -> str:
    """A body's first non-blank line as a table cell: code, cut to `width` characters."""
    line = next((line.strip() for line in body.split("\n") if line.strip()), "")
    if not line:
        return "(empty)"
    text = (line[:width] + " ...") if len(line) > width else line
    text = text.replace("|", "\\|")
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def render_card(summary: dict, evaluation: dict) -> str:
    spec, cfg, corpus = summary["spec"], summary["train_config"], summary["corpus"]
    role = "draft" if "draft" in summary["name"] else "target"
    site = " --site-packages" if corpus.get("site_packages") else ""
    flags = site + (" --no-docstrings" if corpus.get("no_docstrings") else "")
    schedule = _schedule_rows(summary)
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [llama, python, code, minillm]",
        "---",
        "",
        f"# {summary['name']}",
        "",
        f"A {summary['num_parameters'] / 1e6:.2f}M-parameter Llama-architecture model that "
        "completes Python code, trained from scratch with minillm's own model code on the "
        "CPython standard library"
        + (" and the packages installed beside minillm" if site else "")
        + (", with the docstrings cut out" if corpus.get("no_docstrings") else "")
        + f". It is minillm's bundled {role} model: small enough to ship "
        "inside the package and to run on a laptop CPU, big enough to write plausible Python. "
        "It is a teaching model, not a coding assistant.",
        "",
        "## Model",
        "",
        "| | |",
        "| --- | --- |",
        "| architecture | LlamaForCausalLM (RMSNorm, SwiGLU, RoPE, grouped-query attention) |",
        f"| parameters | {summary['num_parameters']:,} (embeddings tied with the output layer) |",
        f"| hidden size / layers | {spec['hidden_size']} / {spec['num_hidden_layers']} |",
        f"| attention heads / KV heads | {spec['num_attention_heads']} / "
        f"{spec['num_key_value_heads']} |",
        f"| FFN size | {spec['intermediate_size']} |",
        "| vocabulary | 4,096-token byte-level BPE; `<\\|bos\\|>`=0, `<\\|eos\\|>`=1, "
        "`<\\|pad\\|>`=2 |",
        f"| context | trained at {cfg['seq_len']} tokens; RoPE theta 10,000; "
        "max_position_embeddings 1,024 |",
        "| weights | bfloat16 safetensors |",
        "",
        "## Training data",
        "",
        f"{corpus['corpus'].split(' (')[0]}: its {corpus['num_files']:,} `.py` files "
        "(site-packages excluded), read in sorted order. A file is held out for validation when "
        "the first 8 bytes of the SHA-256 of its relative path, read as a fraction of 2^64, fall "
        f"below 0.02: {corpus['num_validation_files']} files. The training split has "
        f"{corpus['num_train_files']:,} files, {corpus['num_train_bytes'] / 1e6:.1f} MB, "
        f"{(corpus['num_train_tokens'] - corpus.get('num_site_packages_tokens', 0)) / 1e6:.2f}M "
        "tokens (each file is `<|bos|>` + text + `<|eos|>`). The tokenizer is trained on this "
        "split alone.",
        "",
        *_docstring_lines(corpus),
        *_site_packages_lines(corpus),
        "The standard library is distributed under the Python Software Foundation License "
        "Version 2 (Copyright (c) 2001 Python Software Foundation; All Rights Reserved). Much "
        "of it is the `test` package, whose style the model imitates.",
        "",
        "## Training",
        "",
        "| | |",
        "| --- | --- |",
        f"| hardware | {summary['hardware']['cpu']}, {summary['hardware']['threads']} thread(s) "
        "(CPU only) |",
        "| precision | float32 weights and optimizer state, "
        + ("bfloat16 matmuls (autocast) |" if cfg.get("bf16_autocast") else "float32 matmuls |"),
        f"| software | Python {summary['software']['python']}, "
        f"PyTorch {summary['software']['torch']} |",
        *schedule[:2],
        f"| tokens seen | {summary['tokens_seen'] / 1e6:.2f}M "
        f"({summary['tokens_seen'] / corpus['num_train_tokens']:.2f} epochs), "
        f"{summary['tokens_per_s']:,.0f} tokens/s |",
        f"| optimizer | AdamW, betas (0.9, 0.95), weight decay {cfg['weight_decay']}, "
        f"gradient clip {cfg['grad_clip']} |",
        *schedule[2:],
        "",
        "![loss curve](loss_curve.png)",
        "",
        "## Evaluation",
        "",
        f"Held-out cross-entropy: **{evaluation['heldout_loss']:.4f} nats/token** "
        f"(perplexity **{evaluation['heldout_perplexity']:.2f}**), over "
        f"{evaluation['heldout_num_predicted_tokens']:,} predicted tokens: "
        f"{evaluation['heldout_num_windows']} windows of {cfg['seq_len'] + 1} tokens spread "
        "evenly over the validation files' token stream. The windows are stored in "
        f"`{HELDOUT_FILE}`; the numbers are measured on the shipped bfloat16 weights upcast "
        "to float32, and minillm's tests recompute them.",
        "",
    ]
    if "foreign_loss" in evaluation:
        credits = ", ".join(
            f"{s['name']} {s['version']} ({s['license']})" for s in evaluation["foreign_sources"]
        )
        lines += [
            "### Python from outside the standard library",
            "",
            "The held-out files above are still the standard library's code, in its style. To "
            "see how the model does on Python it never saw, written by other people in other "
            f"styles, `{FOREIGN_FILE}` holds {evaluation['foreign_num_windows']} windows of "
            f"{cfg['seq_len'] + 1} tokens spread evenly over {evaluation['foreign_num_files']} "
            f"files of {credits}, installed with minillm at the versions its constraints file "
            "pins. A file is taken when the SHA-256 of its path, read as a fraction of 2^64, "
            f"falls below {FOREIGN_FRACTION} (a table of license data, "
            f"{', '.join(sorted(FOREIGN_EXCLUDED))}, is left out). On them the cross-entropy is "
            f"**{evaluation['foreign_loss']:.4f} nats/token** (perplexity "
            f"**{evaluation['foreign_perplexity']:.2f}**), over "
            f"{evaluation['foreign_num_predicted_tokens']:,} predicted tokens.",
            "",
            f"Ten function headers written for this test are completed greedily, up to "
            f"{HEADER_NEW_TOKENS} tokens. The body is the completion up to the first non-empty "
            "line indented no deeper than the header (the model has gone on to other code) or "
            "`<|eos|>`; when the token limit stopped it, the last, possibly cut, line is "
            "dropped. A method's prompt includes its class line. Header and body parse with "
            f"`ast.parse` for **{evaluation['headers_parsed']} of {len(evaluation['headers'])}** "
            "headers. Parsing is all this checks: a body can parse and still not do what the "
            "name says.",
            "",
            "| header | first line of the body | body ends at | parses |",
            "| --- | --- | --- | --- |",
        ]
        lines += [
            f"| `{h['header'].split(chr(10))[-1].strip()}` | {_first_body_line(h['body'])} | "
            f"{h['stop']} | {'yes' if h['parses'] else 'no'} |"
            for h in evaluation["headers"]
        ]
        lines.append("")
    if "acceptance" in evaluation:
        acc = evaluation["acceptance"]
        lines += [
            "### Agreement with the target model",
            "",
            f"Along the greedy continuations ({ACCEPTANCE_NEW_TOKENS} tokens at most) of "
            f"minillm-stdlib-target for {acc['num_prompts']} fixed prompts, this draft's argmax "
            f"equals the target's at **{acc['greedy_acceptance_rate']:.1%}** of "
            f"{acc['num_positions']} positions. In greedy speculative decoding with "
            f"k = {acc['draft_length']} draft tokens per round, it has "
            f"**{acc['mean_accepted_per_round']:.2f}** proposals accepted per round, so each "
            f"target forward yields {acc['mean_tokens_per_round']:.2f} tokens on average.",
            "",
        ]
    lines += [
        f"## Sample completions (greedy, up to {SAMPLE_NEW_TOKENS} tokens)",
        "",
        "Each block is the prompt (shown as a Python string above it) and, after it, the "
        "greedy completion (argmax of `forward_causal` at each step), stopped at `<|eos|>` "
        "or the token limit.",
        "",
    ]
    for sample in evaluation["samples"]:
        lines += [
            f"**`{sample['prompt']!r}`**",
            "",
            "```python",
            (sample["prompt"] + sample["completion"]).rstrip("\n"),
            "```",
            "",
        ]
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{summary["name"]}")  # this directory',
        f'tokenizer = AutoTokenizer.from_pretrained("{summary["name"]}")',
        "```",
        "",
        "The tokenizer adds `<|bos|>` in front, as in training; generation stops at `<|eos|>`.",
        "",
        "## Reproduce",
        "",
        "```",
        *_fit_commands(summary, role, flags),
        "python -m minillm.training.train card",
        "```",
        "",
        "The run reads the standard library of the interpreter it runs on"
        + (" and the packages installed beside it" if site else "")
        + ", so another Python version"
        + (" or another set of packages" if site else "")
        + " gives another corpus. Under a wall-clock budget the number of steps depends "
        "on the machine; with `--max-steps` alone a run is deterministic.",
        "",
        "## Limitations",
        "",
        f"The model has seen only Python source, {summary['tokens_seen'] / 1e6:.0f} million "
        "tokens of it, with a 256-token context. It repeats itself, invents APIs, and writes "
        "code that does not run. Do not "
        "use its output for anything but studying how an inference engine works.",
        "",
    ]
    return "\n".join(lines)


def write_card(model_dir: pathlib.Path, evaluation: dict) -> None:
    """Store `evaluation` in the summary file and regenerate README.md from it."""
    summary_path = model_dir / SUMMARY_FILE
    summary = json.loads(summary_path.read_text())
    summary["evaluation"] = evaluation
    summary_path.write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    (model_dir / "README.md").write_text(render_card(summary, evaluation))


def write_cards(target_dir: pathlib.Path, draft_dir: pathlib.Path) -> None:
    """Measure both models and rewrite their cards; the foreign set is built once, if absent."""
    for model_dir in (target_dir, draft_dir):
        if not (model_dir / FOREIGN_FILE).exists():
            heldout = json.loads((model_dir / HELDOUT_FILE).read_text())["token_ids"]
            write_foreign_set(model_dir, window_len=len(heldout[0]), num_windows=len(heldout))
    write_card(target_dir, measure(target_dir))
    write_card(draft_dir, measure(draft_dir, target_dir=target_dir))
