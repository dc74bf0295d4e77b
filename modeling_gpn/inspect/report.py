"""The report: every measurement of `modeling_gpn.analysis` and the causal tests as one dict (`build_report`,
numpy arrays kept for the figures), and its JSON-safe part for report.json (`report_json`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import analysis
from .ablations import causal_tests
from .states import Collected, document_ids


def build_report(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    windows: torch.Tensor,
    collected: Collected,
    top_k: int = 10,
    max_geometry_states: int = 16384,
    ablation_windows: int | None = None,
    batch_size: int = 8,
    run_ablations: bool = True,
    seed: int = 0,
    progress: bool = True,
    reset_after: int | None = None,
) -> dict:
    """All measurements and causal tests as one dict (numpy arrays kept for the figures).

    `reset_after`: the token id (EOS) after which every document started from the zero state when `collected`
    was collected (`collect(..., reset_after=...)`); the causal tests run so too, and the horizons and the memory
    retention pair only positions inside one document. None: the state ran on across documents."""
    num_windows, length = windows.shape
    documents = None if reset_after is None else document_ids(windows, reset_after)
    report: dict = {
        "model": model_summary(model, collected.states.shape[-1]),
        "data": {
            "windows": num_windows,
            "seq_len": length,
            "tokens": num_windows * length,
            "predicted_tokens": collected.nll_count,
            "perplexity": collected.perplexity,
            "document_resets": reset_after is not None,
        },
    }
    report["geometry"] = analysis.state_geometry(sampled_states(collected.states, max_geometry_states, seed), seed=seed)
    report["mean_direction"] = mean_direction_report(model, tokenizer, windows, collected, top_k)
    report["horizons"] = analysis.state_horizons(collected.states, documents=documents)
    report["memory"] = (
        analysis.memory_retention(collected.gammas, documents=documents) if collected.gammas is not None else None
    )
    report["ablations"] = None
    if run_ablations:
        s_bar = report["mean_direction"]["s_bar"]
        report["ablations"] = causal_tests(
            model, windows, s_bar, report["memory"], ablation_windows, batch_size, progress, reset_after
        )
    return report


def model_summary(model: PreTrainedModel, state_dim: int) -> dict:
    """The report's facts about `model`: its name, widths, layers, memory and parameter count."""
    return {
        "name_or_path": getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None),
        "hidden_size": state_dim,
        "num_predict_layers": model.config.num_predict_layers,
        "use_memory": bool(model.config.use_memory),
        "num_memory_heads": model.config.num_memory_heads if model.config.use_memory else 0,
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "adapter": adapter_summary(model),
    }


def adapter_summary(model: PreTrainedModel) -> dict | None:
    """The PEFT adapter attached to `model` (a MODEL that is an adapter folder loads as its base with it attached),
    or None: the report named only the adapter folder, and counted the adapter's parameters as the model's, without
    saying that every number is the adapted model's or which base it adapts."""
    if not getattr(model, "_hf_peft_config_loaded", False):
        return None
    configs = getattr(model, "peft_config", {}) or {}
    return {
        "base_model": sorted({str(c.base_model_name_or_path) for c in configs.values()}),
        "peft_type": sorted({str(getattr(c.peft_type, "value", c.peft_type)) for c in configs.values()}),
        # (PEFT names an adapter's own weights after it: lora_A.default.weight, modules_to_save.default.weight)
        "adapter_parameters": int(
            sum(p.numel() for n, p in model.named_parameters() if any(f".{a}." in n for a in configs))
        ),
    }


def sampled_states(states: np.ndarray, max_states: int, seed: int) -> np.ndarray:
    """The states (n, T, d) as rows (n * T, d), at most `max_states` of them sampled (in order) with `seed`."""
    flat = states.reshape(-1, states.shape[-1])
    if flat.shape[0] > max_states:
        rng = np.random.default_rng(seed)
        flat = flat[np.sort(rng.choice(flat.shape[0], size=max_states, replace=False))]
    return flat


def mean_direction_report(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, windows: torch.Tensor, collected: Collected, top_k: int
) -> dict:
    """`analysis.mean_direction` of the collected states, decoded through the model, against the data's unigram
    counts and a control (the data's mean token embedding decoded the same way), with readable token labels."""
    device = next(model.parameters()).device
    embedding = model.get_input_embeddings().weight.detach().float()

    @torch.inference_mode()
    def decode(vector: np.ndarray) -> np.ndarray:
        return model.decode(torch.tensor(vector, dtype=torch.float32, device=device)[None]).float().cpu().numpy()[0]

    counts = np.bincount(windows.reshape(-1).numpy(), minlength=model.config.vocab_size)
    mean_embedding = embedding[windows.reshape(-1).to(embedding.device)].mean(0)
    control = (embedding @ mean_embedding).cpu().numpy()
    mean = analysis.mean_direction(collected.states, decode, unigram_counts=counts, top_k=top_k, control_logits=control)
    mean["top_tokens"] = [_token_label(tokenizer, i) for i in mean["top_ids"]]
    mean["control_top_tokens"] = [_token_label(tokenizer, i) for i in mean.get("control_top_ids", [])]
    data_top = np.argsort(-counts, kind="stable")[:top_k]
    mean["data_top_tokens"] = [_token_label(tokenizer, i) for i in data_top]
    mean["control_note"] = "control = the data's mean token embedding decoded through the tied output embedding (E·ē)"
    return mean


# How tokenizers spell a space, a newline, a tab and a carriage return inside a token: SentencePiece's "▁" and
# byte fallback (<0x0A>), and byte-level BPE's stand-ins for the bytes (GPT-2's and gpn train's: "Ġ" is the space,
# "Ċ" the newline: the report and its figure showed a newline token as "Ċ").
_TOKEN_SPELLINGS = {
    "▁": "␣",
    "Ġ": "␣",
    "Ċ": "\n",
    "ĉ": "\t",
    "č": "\r",
    "<0x0A>": "\n",
    "<0x09>": "\t",
    "<0x0D>": "\r",
}


def _token_label(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """A token as the report and the figures show it: a space as ␣, a control character (a newline) escaped once,
    as `\\n`."""
    token = str(tokenizer.convert_ids_to_tokens(int(token_id)))
    for spelling, text in _TOKEN_SPELLINGS.items():
        token = token.replace(spelling, text)
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in token)


def _jsonable(value: object):
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


# Arrays kept out of report.json (they are in the figures); everything else is written.
_FIGURE_ONLY = {"norms", "eigenvalues", "corr_hist_counts", "corr_hist_edges", "s_bar", "curves"}


def report_json(report: dict) -> dict:
    """The JSON-safe part of a report (large arrays dropped, numpy converted, NaN/inf -> null)."""

    def strip(value: object):
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
