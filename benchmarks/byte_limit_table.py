"""The before/after table of `benchmarks/byte_limit.sh`'s JSON files: every figure with its ratio to the
byte limit measured in its own run.

    python benchmarks/byte_limit_table.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def path_code(name: str) -> str:
    """The code side of a run named as byte_limit.sh names its files (PRESET-DTYPE-tTHREADS-CODE[ PRESET])."""
    return name.split(" ")[0].rsplit("-", 1)[-1]


def main() -> None:
    folder = Path(sys.argv[1])
    runs = {}
    for path in sorted(folder.glob("*.json")):
        report = json.loads(path.read_text())
        args = report["args"]
        fast = [r for r in report["rows"] if r["impl"] == "fast"]
        if not fast:  # (a run without --impl fast: no figure here to state against its limit)
            print(f"{path}: no fast row, left out", file=sys.stderr)
        for row in fast:  # (one per preset: a plain `gpn bench` run measures tiny and small)
            runs[path.stem if len(fast) == 1 else f"{path.stem} {row['preset']}"] = (args, row)
    lengths = sorted({int(n) for _, row in runs.values() for n in row["decode_ms"]})
    header = [
        "preset",
        "weights",
        "threads",
        "code",
        "limit ms (MB, GB/s)",
        "prompt-token limit ms (MB)",
        "step ms (x limit)",
    ]
    header += [f"decode ms @{n} (x)" for n in lengths] + [f"prefill tok/s @{n} (x)" for n in lengths]
    header += ["tok/s @4 rows", "tok/s @16 rows"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name, (args, row) in sorted(
        runs.items(),
        key=lambda item: (
            item[1][1]["preset"],
            item[1][0]["dtype"],
            item[1][0]["threads"],
            path_code(item[0]) != "before",
        ),
    ):
        limit = row.get("limit_ms")
        ratio = lambda ms: f"{ms:.3f} ({ms / limit:.2f}x)" if (ms and limit) else "-"  # noqa: B023 (called in this iteration)
        code = path_code(name)
        cells = [row["preset"], args["dtype"], str(args["threads"]), code]
        cells.append(
            f"{limit:.3f} ({row['limit_bytes'] / 1e6:.1f}, {row['limit_bytes'] / limit / 1e6:.0f})" if limit else "-"
        )
        cells.append(
            f"{row['prefill_limit_ms']:.3f} ({row['prefill_limit_bytes'] / 1e6:.1f})"
            if row.get("prefill_limit_ms")
            else "-"
        )
        cells.append(ratio(row.get("step_ms")))
        for n in lengths:
            at = row.get("limit_ms_at", {}).get(str(n)) or limit
            ms = row["decode_ms"].get(str(n))
            cells.append(f"{ms:.3f} ({ms / at:.2f}x)" if (ms and at) else "-")
        for n in lengths:  # (the prompt token's limit read beside that length's generate() calls)
            tok_s = row["prefill_tok_s"].get(str(n))
            prompt_limit = row.get("prefill_limit_ms_at", {}).get(str(n)) or row.get("prefill_limit_ms")
            cells.append(f"{tok_s:,.0f} ({1e3 / tok_s / prompt_limit:.2f}x)" if (tok_s and prompt_limit) else "-")
        # (a batch not measured is "-": it printed 0 tok/s)
        cells += [f"{row['batch_tok_s'][str(b)]:,.0f}" if str(b) in row["batch_tok_s"] else "-" for b in (4, 16)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
