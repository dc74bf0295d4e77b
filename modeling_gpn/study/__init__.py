"""`gpn study`: the paper's central comparison at a scale that runs here.

One study file (`configuration/studies/NAME.json`) names a shared training recipe (data, tokenizer,
windows, steps, optimiser, seed), the models to compare (GPN without memory, 1-layer GPN+M, 2-layer
GPN+M, a Transformer++ = `LlamaForCausalLM`, a Gated DeltaNet = Qwen3-Next with every layer
gated-delta linear attention and a dense MLP) and the evaluation settings. Every model goes through
the same `gpn train` pipeline (same tokenizer, token stream, budget, recipe and seed) and the same
`gpn eval` tasks; the study then writes one comparison report:

    OUTPUT/study_report.md     the table in the paper's shape, ratios beside the paper's, a reading
    OUTPUT/study_results.json  every number
    OUTPUT/training_curves.png loss against tokens for every model
    OUTPUT/<model>/            each model's run directory (model/, log.jsonl, eval/, and study_run.json:
                               what a later run of the same study reuses, or resumes from)

Parameter counts are reported with and without the token embedding (the study matches models on
non-embedding parameters, since at this scale the embedding would dominate a total-count match).

Where its parts live (this face re-exports their public names):

    definition.py  study files: `load_study`, `study_path`
    runs.py        `run_study`; each model trained (`train_one`) and evaluated (`evaluate_one`)
    comparison.py  the table's rows, the ratios to the baselines, the reading (`PAPER_TABLE`)
    report.py      study_report.md (`render_report`) and training_curves.png (`plot_curves`)
    cli.py         `add_arguments`, `run`
"""

from __future__ import annotations

from .cli import add_arguments, run
from .comparison import BASELINES, PAPER_TABLE, pick, ratios, reading, table_row
from .definition import STUDY_DIR_NAME, load_study, study_path
from .report import fmt, plot_curves, render_report
from .runs import describe, evaluate_one, held_out_data, held_out_source, parameter_counts, run_study, train_one

__all__ = [
    "BASELINES",
    "PAPER_TABLE",
    "STUDY_DIR_NAME",
    "add_arguments",
    "describe",
    "evaluate_one",
    "fmt",
    "held_out_data",
    "held_out_source",
    "load_study",
    "parameter_counts",
    "pick",
    "plot_curves",
    "ratios",
    "reading",
    "render_report",
    "run",
    "run_study",
    "study_path",
    "table_row",
    "train_one",
]
