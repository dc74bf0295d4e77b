"""The arguments every Trainer / TRL trainer of the tests takes (tests/ecosystem/test_trl.py, the Trainer and
packed SFT tests of tests/model/test_packed.py)."""

from __future__ import annotations


def common_arguments(tmp_path, **overrides) -> dict:
    """What every trainer here takes: a few CPU steps, no saving, no reporting."""
    values = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        learning_rate=3e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        bf16=False,  # (TRL configs default to bf16, which would also fix the process's Accelerate state at bf16)
    )
    values.update(overrides)
    return values
