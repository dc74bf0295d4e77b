"""`gpn inspect`: look inside a GPN's single state, and test causally what the paper only described.

    gpn inspect MODEL --data DATA --output DIR [--tokens 16384] [--seq-len 2048]

MODEL is a local folder or a Hub repo id; DATA a Hub dataset id or local .txt / .jsonl / .json /
.parquet files (or a folder of them). The command runs the model over `--tokens` tokens cut into
non-overlapping windows of `--seq-len` tokens (each window starts from the zero state, as in training),
collects the predicted state p_t at every position (`output_predicted_states`) and the per-head memory
decays gamma (`output_memory_decays`), and writes to DIR:

- `report.json`: every number below, machine-readable;
- `report.md`: the same as tables;
- `geometry.png` (sorted per-dimension std, off-diagonal correlations, cumulative variance),
  `horizons.png` (state cosine against lag, memory retention per head), `mean_direction.png`
  (running-mean convergence, decoded top tokens) and `ablations.png` (perplexity under each ablation).

Measurements (`modeling_gpn.analysis`): state geometry, the mean direction s_bar, horizons, memory
retention and the fast / slow head pools. Causal tests (the paper's Limitations (3)): perplexity of
the same windows with s_bar subtracted from the decoded state, s_bar subtracted from the state carried
to the next step, the fast pool's heads off, the slow pool's heads off, and every memory read off.
The ablations run `ablated_logits`, a copy of the model's time loop built from the model's own pieces
that reproduces the model's logits exactly when no ablation is active.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .. import analysis

DEFAULT_DATASET = "HuggingFaceFW/fineweb-edu"
DEFAULT_DATASET_CONFIG = "sample-10BT"
LOCAL_EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TEXT_BLOCK_CHARS = 200_000  # plain-text files are tokenized in blocks of about this many characters


# --------------------------------------------------------------------------------------------------
# Model and data
# --------------------------------------------------------------------------------------------------


def load_model(name: str, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False):
    """Load a GPN causal LM from a local folder or the Hub, in eval mode. Clear error for other models."""
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    if getattr(model.config, "model_type", None) != "gpn" or not hasattr(getattr(model, "model", None), "token_inputs"):
        raise ValueError(
            f"gpn inspect analyses GPN models; {name!r} is a {type(model).__name__} "
            f"(model_type={getattr(model.config, 'model_type', None)!r})"
        )
    return model.to(device).eval()


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"could not load a tokenizer from {name!r} ({error}); pass --tokenizer with a folder or Hub id that has one"
        ) from error


def _local_files(data: str) -> list[Path] | None:
    """The local files `data` names (a file, a folder, or a glob), or None if it is not local."""
    path = Path(data)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_EXTENSIONS)
        if not files:
            raise ValueError(f"folder {data!r} holds no {'/'.join(sorted(LOCAL_EXTENSIONS))} files")
    elif any(ch in data for ch in "*?["):
        files = sorted(Path(p) for p in glob.glob(data) if Path(p).is_file())
        if not files:
            raise ValueError(f"no files match {data!r}")
    else:
        return None
    for file in files:
        if file.suffix.lower() not in LOCAL_EXTENSIONS:
            raise ValueError(f"unsupported data file {str(file)!r}: use one of {', '.join(sorted(LOCAL_EXTENSIONS))}")
    return files


def iter_documents(
    data: str, config: str | None = None, split: str = "train", text_column: str = "text"
) -> Iterator[tuple[str, bool]]:
    """Yield (text, ends_document) from local files or a Hub dataset (streamed).

    A plain-text file is one document, yielded in blocks cut at line ends; a jsonl / json / parquet row
    is one document (its `text_column`).
    """
    files = _local_files(data)
    if files is not None:
        for file in files:
            kind = LOCAL_EXTENSIONS[file.suffix.lower()]
            if kind == "text":
                with open(file, encoding="utf-8") as handle:
                    block: list[str] = []
                    size = 0
                    for line in handle:
                        block.append(line)
                        size += len(line)
                        if size >= TEXT_BLOCK_CHARS:
                            yield "".join(block), False
                            block, size = [], 0
                    yield "".join(block), True
            else:
                from datasets import load_dataset

                rows = load_dataset(kind, data_files=str(file), split="train", streaming=True)
                yield from _rows_text(rows, text_column, str(file))
        return
    looks_local = data.startswith((".", "/", "~")) or Path(data).suffix.lower() in LOCAL_EXTENSIONS or data.count("/") > 1
    if looks_local:
        raise ValueError(f"data path {data!r} does not exist (a Hub dataset id looks like 'owner/name')")
    from datasets import load_dataset

    if config is None and data == DEFAULT_DATASET:
        config = DEFAULT_DATASET_CONFIG
    rows = load_dataset(data, config, split=split, streaming=True)
    yield from _rows_text(rows, text_column, data)


def _rows_text(rows, text_column: str, source: str) -> Iterator[tuple[str, bool]]:
    for row in rows:
        if text_column not in row:
            raise ValueError(f"{source} has no column {text_column!r} (columns: {sorted(row)}); pass --text-column")
        text = row[text_column]
        if text:
            yield text, True


def load_token_windows(
    tokenizer,
    data: str,
    seq_len: int,
    max_tokens: int,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    progress: bool = True,
) -> torch.Tensor:
    """Tokenize documents (no special tokens; EOS after each document when the tokenizer has one),
    concatenate them and cut the first `max_tokens // seq_len` non-overlapping windows (n, seq_len)."""
    from tqdm.auto import tqdm

    if seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2, got {seq_len}")
    num_windows = max_tokens // seq_len
    if num_windows < 1:
        raise ValueError(f"--tokens ({max_tokens}) must be at least one window of --seq-len ({seq_len}) tokens")
    needed = num_windows * seq_len
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    with tqdm(total=needed, desc="tokenizing", unit="tok", disable=not progress) as bar:
        for text, ends_document in iter_documents(data, config, split, text_column):
            new = tokenizer(text, add_special_tokens=False)["input_ids"]
            if ends_document and eos is not None:
                new = new + [eos]
            bar.update(min(len(new), needed - len(ids)))
            ids.extend(new)
            if len(ids) >= needed:
                break
    if len(ids) < seq_len:
        raise ValueError(f"{data!r} gave only {len(ids)} tokens, fewer than one window of {seq_len}")
    num_windows = min(num_windows, len(ids) // seq_len)
    return torch.tensor(ids[: num_windows * seq_len], dtype=torch.long).view(num_windows, seq_len)


# --------------------------------------------------------------------------------------------------
# Collecting the state
# --------------------------------------------------------------------------------------------------


@dataclass
class Collected:
    """What one pass of the model over the windows gives: p_t, gamma_t and the per-token loss."""

    states: np.ndarray  # (windows, T, d) float32
    gammas: np.ndarray | None  # (windows, T, H) float32, GPN+M only
    nll_sum: float
    nll_count: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.nll_count)


def _window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token cross-entropy of every window position (logits[:, t] predicts token t+1)."""
    loss = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum"
    )
    return float(loss), input_ids[:, 1:].numel()


@torch.inference_mode()
def collect(model, windows: torch.Tensor, batch_size: int = 8, progress: bool = True) -> Collected:
    """Run the model over `windows` (n, T), each from the zero state, and keep p_t, gamma_t and the loss."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    states, gammas = [], []
    nll_sum, nll_count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="collecting states", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        out = model(batch, output_predicted_states=True, output_memory_decays=True, use_cache=False)
        states.append(out.predicted_states.float().cpu().numpy())
        if out.memory_decays is not None:
            gammas.append(out.memory_decays.float().cpu().numpy())
        s, c = _window_nll(out.logits, batch)
        nll_sum, nll_count = nll_sum + s, nll_count + c
    return Collected(
        states=np.concatenate(states), gammas=np.concatenate(gammas) if gammas else None,
        nll_sum=nll_sum, nll_count=nll_count,
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Causal ablations: the model's time loop with interventions
# --------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Ablation:
    """One intervention on the recurrence (all off by default: the unablated model).

    decode_shift: subtracted from p_t before decoding only (the recurrence is untouched).
    carry_shift: subtracted from p_t before it is carried into the next step (decoding sees p_t).
    heads_off: memory heads kept at zero (never written, so they read back zero).
    reads_off: every predict layer skips its memory read (the memory is still written).
    """

    name: str = "none"
    description: str = "the model as trained"
    decode_shift: torch.Tensor | None = None
    carry_shift: torch.Tensor | None = None
    heads_off: tuple[int, ...] = field(default_factory=tuple)
    reads_off: bool = False


def ablated_logits(model, input_ids: torch.Tensor, ablation: Ablation | None = None) -> torch.Tensor:
    """Logits (batch, T, vocab) of `model` on `input_ids` from the zero state under `ablation`.

    Built from the model's own pieces in the order of `GPNModel.step` (token_inputs, ground,
    memory_write, the predict layers and their read, decode); with no ablation it is the model's
    forward bit for bit.
    """
    from ..modeling_gpn import project

    ablation = ablation or Ablation()
    core = model.model
    config = model.config
    has_memory = core.memory_write is not None
    if (ablation.heads_off or ablation.reads_off) and not has_memory:
        raise ValueError(f"ablation {ablation.name!r} needs a GPN+M (this model has no memory)")
    head_mask = None
    if ablation.heads_off:
        bad = [h for h in ablation.heads_off if not 0 <= h < config.num_memory_heads]
        if bad:
            raise ValueError(f"memory heads {bad} do not exist (the model has {config.num_memory_heads})")
        head_mask = torch.ones(config.num_memory_heads, device=input_ids.device)
        head_mask[list(ablation.heads_off)] = 0.0
        head_mask = head_mask[None, :, None, None]
    batch_size, length = input_ids.shape
    token_inputs = core.token_inputs(core.embed_tokens(input_ids))
    predicted, grounded, memory = core.zero_state(batch_size, input_ids.device)
    outputs = []
    for t in range(length):
        new_grounded = core.ground(predicted, token_inputs[:, t])
        if has_memory:
            memory, _ = core.memory_write(memory, grounded, new_grounded)
            if head_mask is not None:
                memory = memory * head_mask
        state = new_grounded
        for layer in core.predict_layers:
            if has_memory and not ablation.reads_off:
                state = layer(state, memory)
            elif not has_memory:
                state = layer(state, None)
            else:  # the predict layer without its read
                keep = torch.sigmoid(project(layer.gate, layer.gate_norm(state)))
                state = keep * state + layer.ffn(state)
        outputs.append(state)
        predicted = state if ablation.carry_shift is None else state - ablation.carry_shift
        grounded = new_grounded
    states = torch.stack(outputs, dim=1)
    if ablation.decode_shift is not None:
        states = states - ablation.decode_shift
    return model.decode(states)


@torch.inference_mode()
def ablation_perplexity(
    model, windows: torch.Tensor, ablation: Ablation, batch_size: int = 8, progress: bool = True
) -> dict:
    """Token perplexity of `windows` under `ablation` (all positions of every window)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    nll_sum, count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=f"ablation: {ablation.name}", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        s, c = _window_nll(ablated_logits(model, batch, ablation), batch)
        nll_sum, count = nll_sum + s, count + c
    return {"nll": nll_sum / count, "perplexity": math.exp(nll_sum / count), "tokens": count}


@torch.inference_mode()
def decoded_perplexity(
    model, states: np.ndarray, windows: torch.Tensor, decode_shift: torch.Tensor | None = None, batch_size: int = 8
) -> dict:
    """Token perplexity of `windows` decoded from already collected predicted `states` (n, T, d),
    optionally with `decode_shift` subtracted before decoding."""
    device = next(model.parameters()).device
    nll_sum, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        p = torch.from_numpy(states[start : start + batch_size]).to(device)
        if decode_shift is not None:
            p = p - decode_shift
        s, c = _window_nll(model.decode(p), batch)
        nll_sum, count = nll_sum + s, count + c
    return {"nll": nll_sum / count, "perplexity": math.exp(nll_sum / count), "tokens": count}


def standard_ablations(model, s_bar: np.ndarray, pools: dict | None) -> list[Ablation]:
    """The causal tests: s_bar out of the decoded state / the recurrence; fast / slow pool off; reads off."""
    device = next(model.parameters()).device
    shift = torch.tensor(s_bar, dtype=torch.float32, device=device)
    ablations = [
        Ablation("mean_removed_decode", "s̄ subtracted from p_t before decoding (recurrence untouched)", decode_shift=shift),
        Ablation("mean_removed_recurrence", "s̄ subtracted from p_t before it is carried to the next step", carry_shift=shift),
    ]  # fmt: skip
    if model.model.memory_write is not None and pools is not None:
        if pools.get("split"):
            ablations.append(Ablation("fast_pool_off", f"fast-pool memory heads {pools['fast_heads']} kept at zero",
                                      heads_off=tuple(pools["fast_heads"])))  # fmt: skip
            ablations.append(Ablation("slow_pool_off", f"slow-pool memory heads {pools['slow_heads']} kept at zero",
                                      heads_off=tuple(pools["slow_heads"])))  # fmt: skip
        ablations.append(Ablation("memory_reads_off", "every memory read skipped (memory still written)", reads_off=True))
    return ablations


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------


def _token_label(tokenizer, token_id: int) -> str:
    token = tokenizer.convert_ids_to_tokens(int(token_id))
    return str(token).replace("▁", "␣").replace("Ġ", "␣").replace("\n", "\\n").replace("<0x0A>", "\\n")


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def build_report(
    model,
    tokenizer,
    windows: torch.Tensor,
    collected: Collected,
    top_k: int = 10,
    max_geometry_states: int = 16384,
    ablation_windows: int | None = None,
    batch_size: int = 8,
    run_ablations: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """All measurements and causal tests as one dict (numpy arrays kept for the figures)."""
    num_windows, length = windows.shape
    d = collected.states.shape[-1]
    report: dict = {
        "model": {
            "name_or_path": getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None),
            "hidden_size": d,
            "num_predict_layers": model.config.num_predict_layers,
            "use_memory": bool(model.config.use_memory),
            "num_memory_heads": model.config.num_memory_heads if model.config.use_memory else 0,
            "parameters": int(sum(p.numel() for p in model.parameters())),
        },
        "data": {"windows": num_windows, "seq_len": length, "tokens": num_windows * length,
                 "predicted_tokens": collected.nll_count, "perplexity": collected.perplexity},  # fmt: skip
    }

    flat = collected.states.reshape(-1, d)
    if flat.shape[0] > max_geometry_states:
        rng = np.random.default_rng(seed)
        flat = flat[np.sort(rng.choice(flat.shape[0], size=max_geometry_states, replace=False))]
    report["geometry"] = analysis.state_geometry(flat, seed=seed)

    device = next(model.parameters()).device
    embedding = model.get_input_embeddings().weight.detach().float()

    @torch.inference_mode()
    def decode(vector: np.ndarray) -> np.ndarray:
        return model.decode(torch.tensor(vector, dtype=torch.float32, device=device)[None]).float().cpu().numpy()[0]

    counts = np.bincount(windows.reshape(-1).numpy(), minlength=model.config.vocab_size)
    mean_embedding = embedding[windows.reshape(-1).to(embedding.device)].mean(0)
    control = (embedding @ mean_embedding).cpu().numpy()
    mean = analysis.mean_direction(
        collected.states, decode, unigram_counts=counts, top_k=top_k, control_logits=control
    )
    mean["top_tokens"] = [_token_label(tokenizer, i) for i in mean["top_ids"]]
    mean["control_top_tokens"] = [_token_label(tokenizer, i) for i in mean.get("control_top_ids", [])]
    data_top = np.argsort(-counts, kind="stable")[:top_k]
    mean["data_top_tokens"] = [_token_label(tokenizer, i) for i in data_top]
    mean["control_note"] = "control = the data's mean token embedding decoded through the tied output embedding (E·ē)"
    report["mean_direction"] = mean

    report["horizons"] = analysis.state_horizons(collected.states)
    pools = None
    if collected.gammas is not None:
        report["memory"] = analysis.memory_retention(collected.gammas)
        pools = report["memory"]
    else:
        report["memory"] = None

    if run_ablations:
        subset = windows if ablation_windows is None else windows[: max(1, ablation_windows)]
        count = subset.shape[0]
        # Decode-only conditions reuse the collected states (one decoder pass, no second recurrence).
        baseline = decoded_perplexity(model, collected.states[:count], subset, None, batch_size)
        rows = [{"name": "baseline", "description": "the model as trained", **baseline, "delta_ppl": 0.0, "delta_pct": 0.0}]
        for ablation in standard_ablations(model, mean["s_bar"], pools):
            decode_only = ablation.carry_shift is None and not ablation.heads_off and not ablation.reads_off
            if decode_only:
                result = decoded_perplexity(model, collected.states[:count], subset, ablation.decode_shift, batch_size)
            else:
                result = ablation_perplexity(model, subset, ablation, batch_size, progress)
            rows.append({
                "name": ablation.name, "description": ablation.description, **result,
                "delta_ppl": result["perplexity"] - baseline["perplexity"],
                "delta_pct": 100.0 * (result["perplexity"] / baseline["perplexity"] - 1.0),
            })  # fmt: skip
        report["ablations"] = {"windows": int(subset.shape[0]), "tokens": int(subset.numel()), "rows": rows,
                               "s_bar_source": "estimated on the same windows (in-sample)"}  # fmt: skip
    else:
        report["ablations"] = None
    return report


# Arrays kept out of report.json (they are in the figures); everything else is written.
_FIGURE_ONLY = {"norms", "eigenvalues", "corr_hist_counts", "corr_hist_edges", "s_bar", "curves"}


def report_json(report: dict) -> dict:
    """The JSON-safe part of a report (large arrays dropped, numpy converted, NaN/inf -> null)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in _FIGURE_ONLY}
        return value

    slim = strip(report)
    geometry = slim.get("geometry")
    if geometry:  # the full eigen-spectrum is large; keep its cumulative variance at a few counts
        lam = report["geometry"]["eigenvalues"]
        cumulative = np.cumsum(lam) / lam.sum()
        marks = [k for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if k <= lam.size]
        geometry["cumulative_variance_at"] = {str(k): float(cumulative[k - 1]) for k in marks}
    memory = slim.get("memory")
    if memory:
        curves = report["memory"]["curves"]
        lags = [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048) if k < curves.shape[0]]
        memory["retention_at"] = {str(k): curves[k].tolist() for k in lags}
    return _jsonable(slim)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return "∞" if value > 0 else "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{max(digits, 4)}g}"


def report_markdown(report: dict, figures: Sequence[str] = ()) -> str:
    """The report as Markdown tables (paper values beside the measured ones where the paper gives them)."""
    m, data, g, mean, hz = report["model"], report["data"], report["geometry"], report["mean_direction"], report["horizons"]
    lines = [
        "# GPN state inspection",
        "",
        f"Model `{m['name_or_path']}`: d = {m['hidden_size']}, {m['num_predict_layers']} predict layer(s), "
        + (f"memory {m['num_memory_heads']} heads" if m["use_memory"] else "no memory")
        + f", {m['parameters']:,} parameters.",
        f"Data: {data['windows']} windows × {data['seq_len']} tokens = {data['tokens']:,} tokens "
        f"(each window from the zero state); perplexity {_fmt(data['perplexity'])} over {data['predicted_tokens']:,} predicted tokens.",
        "",
        "## State geometry",
        "",
        "| measure | this model | paper (1L GPN+M, 130M) |",
        "|---|---|---|",
        f"| states analysed | {g['num_states']:,} | 16k |",
        f"| ‖p‖ mean (std) | {_fmt(g['norm_mean'])} ({_fmt(g['norm_std'])}) | 132 (9) |",
        f"| per-dim std min – max | {_fmt(g['dim_std_min'])} – {_fmt(g['dim_std_max'])} | 1.05 – 11.3 |",
        f"| dead dims ({g['dead_dim_rule']}) | {g['dead_dims']} | 0 |",
        f"| mean \\|off-diag corr\\| (max) | {_fmt(g['offdiag_corr_mean_abs'])} ({_fmt(g['offdiag_corr_max_abs'])}) | 0.027 (0.61) |",
        f"| PCs for 90% / 99% variance | {g['components_for_90pct']} / {g['components_for_99pct']} of {g['state_dim']} | 1131 / 2099 of 2496 |",
        f"| stable rank | {_fmt(g['stable_rank'])} | ≈40 |",
        f"| participation ratio | {_fmt(g['participation_ratio'])} | ≈398 |",
        "",
        f"Spectrum: {g['spectrum_note']}.",
        "",
        "## Mean direction s̄",
        "",
        "| measure | this model | paper |",
        "|---|---|---|",
        f"| ‖s̄‖ (share of mean ‖p‖) | {_fmt(mean['norm'])} ({100 * mean['share_of_state_norm']:.0f}%) | 107 (58%) |",
        f"| per-batch mean cosine, {mean['num_batches']} batches (pairwise mean ± std) | "
        f"{_fmt(mean['batch_cosine_mean'])} ± {_fmt(mean['batch_cosine_std'])} | 0.988 ± 0.005 |",
        f"| Spearman(decoded s̄, data unigram), seen tokens / all vocab | "
        f"{_fmt(mean.get('spearman_unigram_seen_tokens'))} / {_fmt(mean.get('spearman_unigram_all_vocab'))} | +0.46 (training unigram) |",
        f"| running mean reaches cos 0.98 / 0.996 at token | {_fmt(mean.get('running_mean_reaches_0.98_at_token'))} / "
        f"{_fmt(mean.get('running_mean_reaches_0.996_at_token'))} | 10 / 100 |",
        f"| decoded mean embedding: top-{len(mean['top_ids'])} overlap, logit cosine | "
        f"{mean.get('control_top_overlap')}/{len(mean['top_ids'])}, {_fmt(mean.get('control_logit_cosine'))} | 0/10, −0.62 |",
        "",
        "Top decoded tokens of s̄ (probability): "
        + ", ".join(f"`{t}` ({p:.3f})" for t, p in zip(mean["top_tokens"], mean["top_probs"])),
        "",
        "Most frequent data tokens: " + ", ".join(f"`{t}`" for t in mean["data_top_tokens"]),
        "",
        "## Horizons",
        "",
        f"E[cos(p_t, p_t+k)]: raw {_fmt(hz['raw_at_1'])} at k = 1 and {_fmt(hz['raw_at_max_lag'])} at k = {hz['max_lag']} "
        f"(paper: plateau ≈0.65 to k = 1500); centred on each sequence's mean {_fmt(hz['centred_at_1'])} at k = 1 "
        f"(paper 0.31), below 0.05 from k = {_fmt(hz['centred_below_0.05_at_lag'])} (paper ≈0 by k ≈ 256).",
        "",
    ]
    memory = report.get("memory")
    if memory:
        lines += [
            "## Memory retention",
            "",
            f"Half-life = lag where the running product of e^γ, averaged over start positions, reaches 1/e "
            f"(window {memory['max_lag']} tokens; past it, extrapolated at the head's average rate, marked *). "
            f"Pools: {memory['rule']}"
            + (f", cut at {_fmt(memory['threshold'])} tokens (pool ratio {_fmt(memory.get('pool_ratio'))}×)." if memory["split"]
               else f": no split (pool ratio {_fmt(memory.get('pool_ratio'))}× below 2×)."),
            "",
            "| head | half-life (tokens) | −1/mean γ | pool |",
            "|---|---|---|---|",
        ]  # fmt: skip
        order = np.argsort(memory["half_lives"])
        for h in order:
            pool = "fast" if h in memory["fast_heads"] else "slow"
            star = "*" if memory["half_life_beyond_window"][h] else ""
            lines.append(f"| {h} | {_fmt(memory['half_lives'][h])}{star} | {_fmt(memory['mean_rate_half_lives'][h])} | {pool} |")
        fast = [memory["half_lives"][h] for h in memory["fast_heads"]]
        slow = [memory["half_lives"][h] for h in memory["slow_heads"]]
        lines += ["", f"Fast pool: {len(fast)} heads" + (f" ({_fmt(min(fast))}–{_fmt(max(fast))} tokens)" if fast else "")
                  + f"; slow pool: {len(slow)} heads" + (f" ({_fmt(min(slow))}–{_fmt(max(slow))} tokens)" if slow else "")
                  + ". Paper: 6 fast (1–3 tokens), 9 slow (5–322 tokens).", ""]  # fmt: skip
    ablations = report.get("ablations")
    if ablations:
        lines += [
            "## Causal tests",
            "",
            f"Perplexity over {ablations['rows'][0]['tokens']:,} predicted tokens ({ablations['windows']} windows of "
            f"{ablations['tokens'] // ablations['windows']}); s̄ {ablations['s_bar_source']}. Baseline and the decode-only "
            "condition decode the collected states; the others rerun the time loop with the intervention.",
            "",
            "| condition | what changes | PPL | ΔPPL | Δ% |",
            "|---|---|---|---|---|",
        ]
        for row in ablations["rows"]:
            lines.append(f"| {row['name']} | {row['description']} | {row['perplexity']:.3f} | "
                         f"{row['delta_ppl']:+.3f} | {row['delta_pct']:+.1f}% |")  # fmt: skip
        lines.append("")
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Figures
# --------------------------------------------------------------------------------------------------


def write_figures(report: dict, output: Path) -> list[str]:
    """Write geometry.png, mean_direction.png, horizons.png and (with ablations) ablations.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    g = report["geometry"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(np.arange(1, g["sorted_dim_std"].size + 1), g["sorted_dim_std"], color="C0")
    ax.set_yscale("log")
    ax.set_xlabel("dimension (sorted by std)")
    ax.set_ylabel("std of p_t along the dimension")
    ax.set_title(f"(a) per-dim std: {g['dim_std_min']:.3g}–{g['dim_std_max']:.3g}, {g['dead_dims']} dead")
    ax.grid(alpha=0.3)
    ax = axes[1]
    edges, counts = g["corr_hist_edges"], g["corr_hist_counts"]
    ax.bar((edges[:-1] + edges[1:]) / 2, counts, width=np.diff(edges), color="C1", edgecolor="none")
    ax.set_yscale("log")
    ax.set_xlabel("off-diagonal correlation")
    ax.set_ylabel("number of dimension pairs")
    ax.set_title(f"(b) correlations ({g['correlation_sample_dims']}-dim sample): mean |r| = {g['offdiag_corr_mean_abs']:.3f}")
    ax.grid(alpha=0.3)
    ax = axes[2]
    lam = g["eigenvalues"]
    cumulative = np.cumsum(lam) / lam.sum()
    ax.plot(np.arange(1, lam.size + 1), cumulative, color="C2", label="cumulative variance")
    for frac, key, colour in ((0.9, "components_for_90pct", "C3"), (0.99, "components_for_99pct", "C4")):
        ax.axhline(frac, color=colour, ls=":", lw=1)
        ax.axvline(g[key], color=colour, ls="--", lw=1, label=f"{frac:.0%}: {g[key]} PCs")
    ax.set_xscale("log")
    ax.set_xlabel("principal components (log)")
    ax.set_ylabel("fraction of variance")
    ax.set_title(f"(c) stable rank {g['stable_rank']:.1f}, participation ratio {g['participation_ratio']:.1f}")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.suptitle(f"State geometry ({g['num_states']:,} states, d = {g['state_dim']})")
    fig.tight_layout()
    path = output / "geometry.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    mean = report["mean_direction"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    curve = mean["running_mean_cosine"]
    ax.plot(np.arange(1, curve.size + 1), curve, color="C0", label="cos(running mean of p, s̄)")
    ax.axhline(0.98, color="C3", ls=":", lw=1, label="0.98")
    ax.set_xscale("log")
    ax.set_xlabel("tokens read (log)")
    ax.set_ylabel("cosine with s̄")
    ax.set_title(f"(a) running mean converges to s̄ (‖s̄‖ = {mean['norm']:.3g}, {mean['share_of_state_norm']:.0%} of ‖p‖)")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    ax = axes[1]
    labels = [repr(t)[1:-1] for t in mean["top_tokens"]][::-1]
    ax.barh(np.arange(len(labels)), mean["top_probs"][::-1], color="C1")
    ax.set_yticks(np.arange(len(labels)), labels)
    ax.set_xlabel("probability after decoding s̄")
    spearman = mean.get("spearman_unigram_seen_tokens")
    ax.set_title(f"(b) s̄ decoded: top tokens (Spearman with data unigram {spearman:+.2f})" if spearman is not None
                 and math.isfinite(spearman) else "(b) s̄ decoded: top tokens")  # fmt: skip
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    path = output / "mean_direction.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    hz, memory = report["horizons"], report.get("memory")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    ax.plot(hz["lags"], hz["raw"], "o-", ms=3, color="C0", label="raw p_t")
    ax.plot(hz["lags"], hz["centred"], "o-", ms=3, color="C3", label="centred on each sequence's mean")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("lag k (tokens, log)")
    ax.set_ylabel("E[cos(p_t, p_t+k)]")
    ax.set_title("(a) state horizon")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    if memory:
        curves = memory["curves"]
        lags = np.arange(1, curves.shape[0])
        for h in range(curves.shape[1]):
            fast = h in memory["fast_heads"]
            colour = "C3" if fast else "C0"
            ax.plot(lags, curves[1:, h], color=colour, lw=1.2, alpha=0.85)
            life = memory["half_lives"][h]
            if math.isfinite(life) and 1 <= life <= lags[-1]:
                ax.plot([life], [analysis.INV_E], "o", color=colour, ms=4)
        ax.axhline(analysis.INV_E, color="gray", ls=":", lw=1)
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color="C3", label=f"fast pool ({len(memory['fast_heads'])} heads)"),
                   Line2D([], [], color="C0", label=f"slow pool ({len(memory['slow_heads'])} heads)"),
                   Line2D([], [], color="gray", ls=":", label="1/e (dots: half-lives)")]  # fmt: skip
        ax.legend(handles=handles, loc="lower left")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("lag k (tokens, log)")
        ax.set_ylabel("retention ∏ e^γ (mean over starts)")
        ax.set_title("(b) memory retention per head")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no matrix memory (GPN)", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.suptitle("Temporal horizons")
    fig.tight_layout()
    path = output / "horizons.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    ablations = report.get("ablations")
    if ablations:
        rows = ablations["rows"]
        base = rows[0]["perplexity"]
        fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(rows)), 4.5))
        deltas = [r["delta_pct"] for r in rows]
        colours = ["gray"] + ["C3" if d > 0 else "C2" for d in deltas[1:]]
        bars = ax.bar(np.arange(len(rows)), deltas, color=colours)
        for bar, row in zip(bars, rows):
            label = f"PPL {row['perplexity']:.4g}" + ("" if row["name"] == "baseline" else f"\n{row['delta_pct']:+.1f}%")
            up = bar.get_height() >= 0
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom" if up else "top", xytext=(0, 3 if up else -3), textcoords="offset points")  # fmt: skip
        ax.axhline(0, color="gray", lw=1)
        low, high = min(deltas + [0.0]), max(deltas + [0.0])
        if max(abs(low), abs(high)) > 20:  # large and small changes both readable: linear within ±1%
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(-(abs(low) * 12 + 1) if low < 0 else -1, high * 12 + 1)
        else:
            span = max(high - low, 1e-3)
            ax.set_ylim(low - 0.25 * span, high + 0.25 * span)
        ax.set_xticks(np.arange(len(rows)), [r["name"].replace("_", "\n") for r in rows])
        ax.set_ylabel("perplexity change vs baseline (%)" + (", symlog" if max(abs(low), abs(high)) > 20 else ""))
        ax.set_title(f"Causal tests: perplexity with one part removed (baseline {base:.4g}, {ablations['tokens']:,} tokens)")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        path = output / "ablations.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="GPN model: a local folder (save_pretrained) or a Hub repo id")
    parser.add_argument("--data", default=DEFAULT_DATASET,
                        help="Hub dataset id, or local .txt/.jsonl/.json/.parquet file(s), a folder or a glob")  # fmt: skip
    parser.add_argument("--data-config", default=None,
                        help=f"Hub dataset configuration; None means {DEFAULT_DATASET_CONFIG} for {DEFAULT_DATASET}")  # fmt: skip
    parser.add_argument("--split", default="train", help="Hub dataset split (streamed)")
    parser.add_argument("--text-column", default="text", help="column holding the text in jsonl/parquet/Hub data")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id; None means the model's own")
    parser.add_argument("--output", required=True, help="folder for report.json, report.md and the PNG figures")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="token budget: this many tokens, cut into windows of --seq-len")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=None,
                        help="window length; None means the model's max_length_hint, else 2048")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8, help="windows per forward pass")
    parser.add_argument("--top-k", type=int, default=10, help="decoded tokens of s̄ to report")
    parser.add_argument("--max-geometry-states", type=int, default=16384,
                        help="states sampled for the geometry (the paper used 16k)")  # fmt: skip
    parser.add_argument("--ablation-tokens", type=int, default=None,
                        help="tokens (first windows) for the causal tests; None means all of --tokens")  # fmt: skip
    parser.add_argument("--no-ablations", action="store_true", help="skip the causal tests")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights' dtype (the state and memory stay float32)")  # fmt: skip
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code from the Hub")
    parser.add_argument("--seed", type=int, default=0, help="seed for the sampled states and dimensions")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    started = time.time()
    progress = not args.quiet
    for name in ("tokens", "batch_size", "top_k", "max_geometry_states"):
        if getattr(args, name) < 1:
            raise SystemExit(f"gpn inspect: --{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    model = load_model(args.model, args.device, args.dtype, args.trust_remote_code)
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
    seq_len = args.seq_len or model.config.max_length_hint or 2048
    windows = load_token_windows(
        tokenizer, args.data, seq_len, args.tokens, args.data_config, args.split, args.text_column, progress
    )
    if windows.max() >= model.config.vocab_size:
        raise SystemExit(f"gpn inspect: the tokenizer produced id {int(windows.max())} but the model's vocabulary has "
                         f"{model.config.vocab_size} tokens; pass the tokenizer the model was trained with")  # fmt: skip
    collected = collect(model, windows, args.batch_size, progress)
    ablation_windows = None if args.ablation_tokens is None else max(1, args.ablation_tokens // seq_len)
    report = build_report(
        model, tokenizer, windows, collected, top_k=args.top_k, max_geometry_states=args.max_geometry_states,
        ablation_windows=ablation_windows, batch_size=args.batch_size, run_ablations=not args.no_ablations,
        seed=args.seed, progress=progress,
    )  # fmt: skip
    report["data"]["source"] = args.data
    report["model"]["name_or_path"] = args.model
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    figures = write_figures(report, output)
    summary = report_json(report)
    summary["figures"] = [Path(f).name for f in figures]
    summary["seconds"] = round(time.time() - started, 1)
    (output / "report.json").write_text(json.dumps(summary, indent=1, allow_nan=False) + "\n")
    (output / "report.md").write_text(report_markdown(report, figures))
    print(report_markdown(report))
    print(f"wrote {output / 'report.json'}, {output / 'report.md'} and {len(figures)} figures to {output}")
    return 0
