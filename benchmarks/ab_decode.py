"""A/B of decoding speed through generate(), in one process: the modeling code of two git revisions, same weights.

Issue 22 (edited weights): derived weights now live for one forward or one generate() call instead of until a
parameter key changes, so the fold is paid once per generate() call (inside the time to the first token) and
never per decoded token. This measures both sides in turn, inside every repeat (a slow spell of a shared
machine hits both alike): time to the first new token (prefill, fold included) and the median gap between the
later tokens (decode ms per token), greedy, batch 1, for each prompt length.

    python benchmarks/ab_decode.py --old 8078de9 --new WORKTREE --preset small --prompt-lengths 128 1024 \\
        --decode-tokens 32 --repeats 5 --threads 2

`--old` / `--new`: a git revision of this repository, or WORKTREE (the files as they are on disk). Each side's
modeling files (modeling_gpn/*.py) are copied into a package of its own in a temporary
folder and imported from there, so both run in this process; the model is built from the preset with one seed
and the new side loads the old side's weights.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def materialise(revision: str, name: str, folder: Path):
    """Import the modeling files of `revision` (or the worktree) as package `name` from `folder`: every
    modeling_gpn/*.py is copied (the remote-code ones import each other relatively; the others are not imported)."""
    package = folder / name
    package.mkdir()
    if revision == "WORKTREE":
        files = {path.name: path.read_bytes() for path in (REPO / "modeling_gpn").glob("*.py")}
    else:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-tree", "--name-only", revision, "modeling_gpn/"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        files = {
            Path(path).name: subprocess.run(
                ["git", "-C", str(REPO), "show", f"{revision}:{path}"], capture_output=True, check=True
            ).stdout
            for path in listed
            if path.endswith(".py")
        }
    files["__init__.py"] = b""  # (not the package's own, which registers the Auto classes)
    for file_name, content in files.items():
        (package / file_name).write_bytes(content)
    sys.path.insert(0, str(folder))
    return importlib.import_module(f"{name}.modeling_gpn"), importlib.import_module(f"{name}.configuration_gpn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="git revision of the 'before' side (e.g. 8078de9)")
    parser.add_argument("--new", default="WORKTREE", help="git revision of the 'after' side, or WORKTREE (default)")
    parser.add_argument("--preset", default="small", help="model preset (configuration/*.json) or config JSON path")
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--decode-tokens", type=int, default=32, help="new tokens per generate() call")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "int8", "int4"],
        help="int8 / int4: torchao weight-only, as gpn bench",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from modeling_gpn.bench import TokenTimes, synchronize
    from modeling_gpn.cli.quantization import quantize_int4, quantize_int8, weight_dtype
    from modeling_gpn.configuration import load_preset

    config_values = load_preset(args.preset).to_dict()
    dtype = weight_dtype(args.dtype)
    models = {}
    with tempfile.TemporaryDirectory() as folder:
        for side, revision in (("old", args.old), ("new", args.new)):
            modeling, configuration = materialise(revision, f"gpn_ab_{side}", Path(folder))
            config = configuration.GPNConfig(**{k: v for k, v in config_values.items() if k != "model_type"})
            torch.manual_seed(0)
            model = modeling.GPNForCausalLM(config)
            if models:  # the old side's weights, by name (the decoder moved into the base model in 27's work)
                source, names = next(iter(models.values())).state_dict(), set(model.state_dict())
                weights = {name if name in names else f"model.{name}": tensor for name, tensor in source.items()}
                for tied, original in getattr(model, "all_tied_weights_keys", {}).items():
                    weights.setdefault(tied, weights[original])
                model.load_state_dict(weights)
            models[side] = model.to(args.device, dtype).eval()
        if args.dtype in (
            "int8",
            "int4",
        ):  # (once both hold the same weights: a quantized state dict does not load into bf16)
            quantize = quantize_int8 if args.dtype == "int8" else quantize_int4
            models = {side: quantize(model) for side, model in models.items()}

        def timings(model, prompt):
            streamer = TokenTimes(args.device)
            synchronize(args.device)
            start = time.perf_counter()
            model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=args.decode_tokens,
                min_new_tokens=args.decode_tokens,
                do_sample=False,
                streamer=streamer,
                pad_token_id=0,
            )
            stamps = streamer.stamps
            return stamps[1] - start, [b - a for a, b in zip(stamps[1:], stamps[2:])]

        generator = torch.Generator().manual_seed(1)
        print(
            f"preset {args.preset}, {args.dtype}, {args.device}, threads {torch.get_num_threads()}, old {args.old}, "
            f"new {args.new}, {args.decode_tokens} tokens per call, {args.repeats} repeats"
        )
        print(f"{'prompt':>7} {'side':>4} {'first token ms':>15} {'decode ms/token':>16}")
        for length in args.prompt_lengths:
            prompt = torch.randint(1, config.vocab_size, (1, length), generator=generator).to(args.device)
            firsts = {side: [] for side in models}
            gaps = {side: [] for side in models}
            with torch.no_grad():
                for model in models.values():  # warm-up (kernels, caches)
                    timings(model, prompt)
                for _ in range(args.repeats):
                    for side, model in models.items():
                        first, later = timings(model, prompt)
                        firsts[side].append(first)
                        gaps[side] += later
            for side in models:
                print(
                    f"{length:>7} {side:>4} {1e3 * statistics.median(firsts[side]):>15.2f} "
                    f"{1e3 * statistics.median(gaps[side]):>16.3f}"
                )
            ratio = statistics.median(gaps["new"]) / statistics.median(gaps["old"])
            print(f"{length:>7}  new/old decode ms per token: {ratio:.3f}")


if __name__ == "__main__":
    main()
