"""`gpn bench` runs end to end on a tiny preset and reports every figure for every implementation."""

from __future__ import annotations

import json

from modeling_gpn.cli import main


def test_bench_reports_every_implementation(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--preset", "tiny", "--batch", "2", "--seq-len", "12", "--segment-length", "5",
                 "--memory-seq-lens", "24", "--decode-prompt-lengths", "4", "9", "--decode-tokens", "3",
                 "--repeats", "1", "--device", "cpu", "--json", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    for impl in ("plain", "fast", "llama"):
        assert f"| tiny | {impl} |" in printed
    assert "train tok/s / Llama's" in printed and "train peak memory @24 / @12" in printed
    from modeling_gpn import memory_kernels

    kernels = "on" if memory_kernels.available() else "off ("
    assert f"GPN memory kernels {kernels}" in printed
    report = json.loads(out.read_text())
    assert report["memory_kernels"].startswith(kernels)
    rows = {row["impl"]: row for row in report["rows"]}
    for impl, row in rows.items():
        assert row["train_tok_s"] > 0 and row["forward_tok_s"] > 0, impl
        for length in ("4", "9"):
            assert row["prefill_tok_s"][length] > 0 and row["decode_ms"][length] > 0, impl
    # what the fast path's timings ran on (on CPU without GPN_TRITON=1: the torch ops), and no self-check ran
    assert rows["fast"]["backend"] == {"train": "torch ops", "forward": "torch ops", "prefill and decode @4": "torch ops",
                                       "prefill and decode @9": "torch ops"}  # fmt: skip
    assert "fast train ran on: torch ops" in printed and report["triton_self_checks"] == {}
    # a GPN's cache does not grow with the prompt; the Llama's does
    assert rows["fast"]["cache_bytes"]["4"] == rows["fast"]["cache_bytes"]["9"]
    assert rows["llama"]["cache_bytes"]["9"] > rows["llama"]["cache_bytes"]["4"]
