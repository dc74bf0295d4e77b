"""`gpn bench`'s report: one table row per preset and implementation, the byte-limit columns beside the
speed columns, then the fast path's ratios against the targets."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

from .measure import Row


def fmt(value: float | None, kind: str = "num") -> str:
    """`value` as a table cell: '-' for None, else by `kind` (a number, bytes, ...)."""
    if value is None:
        return "-"
    if kind == "bytes":
        for unit in ("B", "KB", "MB", "GB"):
            if abs(value) < 1024 or unit == "GB":
                return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
            value /= 1024
    if kind == "ratio":
        return f"{value:.2f}x"
    if value >= 100:
        return f"{value:,.0f}"
    if 0 < abs(value) < 1:  # three significant digits: a small model's limit is microseconds, not "0.00" ms
        return f"{value:.3g}"
    return f"{value:.2f}"


def _columns(args: argparse.Namespace) -> list[tuple[str, callable]]:
    """(header, cell of a row) for every column this run has figures for."""
    lengths = args.decode_prompt_lengths
    columns = [
        ("preset", lambda r: r.preset),
        ("impl", lambda r: r.impl),
        ("params", lambda r: f"{r.params / 1e6:.2f}M"),
    ]
    if not args.skip_training:
        columns += [
            ("train tok/s", lambda r: fmt(r.train_tok_s)),
            ("train GFLOP/s", lambda r: fmt(r.train_gflop_s)),
            ("fwd tok/s", lambda r: fmt(r.forward_tok_s)),
            ("fwd GFLOP/s", lambda r: fmt(r.forward_gflop_s)),
        ]
        for n in sorted({args.seq_len, *args.memory_seq_lens}):
            columns.append((f"train peak @{n}", lambda r, n=n: fmt(r.train_peak_bytes.get(n), "bytes")))
    if args.decode_batches:
        columns += [
            ("step ms", lambda r: fmt(r.step_ms)),
            ("limit ms", lambda r: fmt(r.limit_ms)),
            ("step / limit", lambda r: fmt(r.limit_ratio(r.step_ms and r.step_ms / 1e3), "ratio")),
        ]
        for b in sorted(set(args.decode_batches) - {1}):
            columns.append((f"tok/s @{b} rows", lambda r, b=b: fmt(r.batch_tok_s.get(b))))
    for n in lengths:
        columns.append((f"prefill tok/s @{n}", lambda r, n=n: fmt(r.prefill_tok_s.get(n))))
        columns.append(
            (
                f"prefill / limit @{n}",
                lambda r, n=n: fmt(
                    r.limit_ratio(1 / r.prefill_tok_s[n], prefill=True, length=n) if n in r.prefill_tok_s else None,
                    "ratio",
                ),
            )
        )
    for n in lengths:
        columns.append((f"decode ms @{n}", lambda r, n=n: fmt(r.decode_ms.get(n))))
        columns.append(
            (
                f"decode / limit @{n}",
                lambda r, n=n: fmt(
                    r.limit_ratio(r.decode_ms[n] / 1e3, length=n) if n in r.decode_ms else None, "ratio"
                ),
            )
        )
    for n in lengths:
        columns.append((f"cache @{n}", lambda r, n=n: fmt(r.cache_bytes.get(n), "bytes")))
    return columns


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    """Print the Markdown table of `rows` with the columns `args` asks for."""
    columns = _columns(args)
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r) for _, cell in columns) + " |")
    print("\n".join(lines))


def print_limits(rows: list[Row]) -> None:
    """What each row's limits are: the bytes a step and a prompt token read, the probe's bandwidth beside the
    steps and beside generate()'s calls at each prompt length (what the decode and prefill ratios use), and
    what read them."""
    for r in rows:
        if not r.limit_bytes:
            continue
        step, prompt = r.limit_bytes, r.prefill_limit_bytes
        if r.limit_ms:
            text = (
                f"{r.preset} {r.impl} limit: {step / 1e6:.1f} MB a step / {step / r.limit_ms / 1e6:.1f} GB/s read "
                f"({r.limit_probe}) = {fmt(r.limit_ms)} ms; a prompt token {prompt / 1e6:.1f} MB / "
                f"{prompt / r.prefill_limit_ms / 1e6:.1f} GB/s = {fmt(r.prefill_limit_ms)} ms"
            )
        else:  # (no steps measured, --decode-batches none: only the reads beside generate())
            text = f"{r.preset} {r.impl} limit: {step / 1e6:.1f} MB a step, a prompt token {prompt / 1e6:.1f} MB ({r.limit_probe})"
        for n, ms in r.limit_ms_at.items():
            text += (
                f"; beside generate() @{n}: {step / ms / 1e6:.1f} GB/s = {fmt(ms)} ms, a prompt token "
                f"{prompt / r.prefill_limit_ms_at[n] / 1e6:.1f} GB/s = {fmt(r.prefill_limit_ms_at[n])} ms"
            )
        print(text)


def print_ratios(rows: list[Row], args: argparse.Namespace) -> None:
    """The issue's targets as ratios of the fast path to the others (>= 1 means met where so stated)."""
    by = {(r.preset, r.impl): r for r in rows}
    for preset in args.preset:
        fast, llama, plain = by.get((preset, "fast")), by.get((preset, "llama")), by.get((preset, "plain"))
        if fast is None:
            continue
        print(f"\n{preset}: fast path")
        if llama is not None and fast.train_tok_s and llama.train_tok_s:
            print(f"  train tok/s / Llama's: {fast.train_tok_s / llama.train_tok_s:.2f} (target >= 0.5)")
            print(f"  forward tok/s / Llama's: {fast.forward_tok_s / llama.forward_tok_s:.2f} (target >= 1.0)")
        if llama is not None:
            for n in args.decode_prompt_lengths:
                if n in fast.decode_ms and n in llama.decode_ms:
                    print(
                        f"  @{n}: Llama decode ms / ours: {llama.decode_ms[n] / fast.decode_ms[n]:.2f} (target >= 5 at 4096); "
                        f"Llama prefill tok/s / ours: {llama.prefill_tok_s[n] / fast.prefill_tok_s[n]:.2f} (target <= 3)"
                    )
        if plain is not None and fast.train_tok_s and plain.train_tok_s:
            print(
                f"  train speed-up over the plain path: {fast.train_tok_s / plain.train_tok_s:.2f}x; "
                f"forward: {fast.forward_tok_s / plain.forward_tok_s:.2f}x"
            )
        if fast.step_ms and fast.limit_ms:
            print(
                f"  one-token step {fast.step_ms:.3f} ms = {fast.step_ms / fast.limit_ms:.2f}x its byte limit "
                f"({fast.limit_ms:.3f} ms; target <= 2 for small, <= 1.5 for gpn-m-1l-130m)"
            )
            for n in args.decode_prompt_lengths:
                if n in fast.decode_ms:
                    print(
                        f"  @{n}: generate() decode {fast.decode_ms[n]:.3f} ms/token, of which beyond the model's step "
                        f"{fast.decode_ms[n] - fast.step_ms:+.3f} ms; prefill {fast.limit_ratio(1 / fast.prefill_tok_s[n], prefill=True, length=n):.2f}x "
                        f"its limit per token (target <= 1.5)"
                    )
        if fast.decode_ms:
            lo, hi = min(fast.decode_ms), max(fast.decode_ms)
            print(f"  decode ms @{hi} / @{lo}: {fast.decode_ms[hi] / fast.decode_ms[lo]:.2f} (target <= 1.10)")
        peaks = fast.train_peak_bytes
        if len(peaks) > 1 and peaks.get(min(peaks)):
            longest, shortest = max(peaks), min(peaks)
            print(
                f"  train peak memory @{longest} / @{shortest}: {peaks[longest] / peaks[shortest]:.2f} (target <= 1.5)"
            )
