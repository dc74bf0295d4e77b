"""`gpn convert SRC OUT`: a reference checkpoint to a transformers folder."""

from __future__ import annotations

import argparse
import sys
import warnings

from .reference import CheckpointError, ConversionNotice, convert


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn convert`."""
    parser.add_argument(
        "src",
        help="the reference trainer's checkpoint.pkl (or its folder), or a folder with params.npz (+ config.json)",
    )
    parser.add_argument(
        "out",
        help="output folder, new or empty (written with save_pretrained: safetensors, config.json, modeling files)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer name or path to save beside the model (e.g. the LLaMA-2 tokenizer); its ids must fit the "
        "model's vocab_size",
    )
    parser.add_argument(
        "--push-to-hub",
        metavar="REPO_ID",
        default=None,
        help="also publish OUT to this Hub repo (see `gpn push`; needs --tokenizer, as a published model carries one)",
    )


def run(args: argparse.Namespace) -> int:
    """Run `gpn convert`: convert the reference checkpoint to a GPN folder (and push it if asked); returns the exit status."""
    if args.push_to_hub and not args.tokenizer:  # gpn push refuses a folder without one: say so before converting
        print(
            "gpn convert: --push-to-hub needs --tokenizer (the one the checkpoint was trained with, e.g. "
            "meta-llama/Llama-2-7b-hf): a published model carries its tokenizer",
            file=sys.stderr,
        )
        return 1
    # SRC is untrusted input: every way it can fail ends in one line that names the problem, never a
    # traceback. CheckpointError carries the specific reasons; the rest are the last resort.
    try:
        with warnings.catch_warnings(record=True) as notices:
            warnings.simplefilter("always", ConversionNotice)
            model = convert(args.src, args.out, tokenizer=args.tokenizer)
    except CheckpointError as error:
        print(f"gpn convert: {error}", file=sys.stderr)
        return 1
    except MemoryError:
        print(
            f"gpn convert: ran out of memory converting {args.src}; the model is too large for this machine",
            file=sys.stderr,
        )
        return 1
    except Exception as error:  # noqa: BLE001 - a fault no check foresaw still gets one line, not a traceback
        print(f"gpn convert: cannot convert {args.src}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    for notice in notices:  # ours one line each (what the conversion changed: the parameters' dtype)
        if issubclass(notice.category, ConversionNotice):
            print(f"gpn convert: note: {notice.message}", file=sys.stderr)
        else:  # (any other warning, as it would have been shown)
            warnings.showwarning(notice.message, notice.category, notice.filename, notice.lineno)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Converted {args.src} -> {args.out} ({n_params:,} parameters, {model.config.memory_cells:,} memory cells)")
    if args.push_to_hub:
        from modeling_gpn.hub import HubPushError, push_folder
        from modeling_gpn.hub.errors import unreachable_hub_errors
        from modeling_gpn.hub.model_card import CardError

        try:
            push_folder(args.out, args.push_to_hub)
        except Exception as error:  # noqa: BLE001 - sorted below: a refusal or an unreachable Hub is one line
            if not isinstance(error, (HubPushError, CardError, *unreachable_hub_errors())):
                raise
            print(f"gpn convert: converted to {args.out}, but did not publish it: {error}", file=sys.stderr)
            return 1
    return 0
