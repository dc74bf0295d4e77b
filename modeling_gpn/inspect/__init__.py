"""`gpn inspect`: look inside a GPN's single state, and test causally what the paper only described.

    gpn inspect MODEL --data DATA --output DIR [--tokens 16384] [--seq-len 2048]

MODEL is a local folder or a Hub repo id; DATA a Hub dataset id or local .txt / .jsonl / .json /
.parquet files (or a folder of them). The command runs the model over `--tokens` tokens cut into
non-overlapping windows of `--seq-len` tokens (each window starts from the zero state, as in training; a
model trained with `gpn train --reset-at-document-start` also starts each document inside a window from it, as
`--[no-]reset-at-document-start` can choose either way), collects the predicted state p_t at every position (`output_predicted_states`) and the per-head memory
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
The ablations run `ablated_states` (the states of `ablated_logits`), a copy of the model's time loop built
from the model's own pieces that reproduces the model's states exactly when no ablation is active.

Where its parts live (this face re-exports their public names):

    inputs.py     the model (`load_model`) and the token windows (`load_token_windows`, `iter_documents`);
                  the tokenizer comes from `modeling_gpn.data.load_tokenizer`
    states.py     `collect`: one pass keeps p_t, gamma_t and the loss (`Collected`); where documents start
                  (`document_ids`; the starts are `modeling_gpn.packing.document_starts`, gpn train's)
    ablations.py  `Ablation`, `ablated_logits`, `ablated_states`, the perplexities and the causal tests
    report.py     `build_report`, `report_json`
    markdown.py   `report_markdown`
    figures.py    `write_figures`
    cli.py        `add_arguments`, `run`
"""

from __future__ import annotations

from .ablations import (
    Ablation,
    ablated_logits,
    ablated_states,
    ablation_perplexity,
    causal_tests,
    decoded_perplexity,
    standard_ablations,
)
from .cli import add_arguments, run
from .figures import write_figures
from .inputs import (
    DEFAULT_DATASET,
    DEFAULT_DATASET_CONFIG,
    LOCAL_EXTENSIONS,
    iter_documents,
    load_model,
    load_token_windows,
)
from .markdown import report_markdown
from .report import build_report, report_json
from .states import Collected, collect, document_ids

__all__ = [
    "Ablation",
    "Collected",
    "DEFAULT_DATASET",
    "DEFAULT_DATASET_CONFIG",
    "LOCAL_EXTENSIONS",
    "ablated_logits",
    "ablated_states",
    "ablation_perplexity",
    "add_arguments",
    "build_report",
    "causal_tests",
    "collect",
    "decoded_perplexity",
    "document_ids",
    "iter_documents",
    "load_model",
    "load_token_windows",
    "report_json",
    "report_markdown",
    "run",
    "standard_ablations",
    "write_figures",
]
