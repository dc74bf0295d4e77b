"""`gpn push`'s command line: one line on stderr and exit 1 for a refused folder or a Hub that refuses."""

from __future__ import annotations

import argparse
import sys

from .checks import token_values
from .errors import CardError, HubPushError, unreachable_hub_errors
from .push import push_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn push`."""
    parser.add_argument(
        "model_dir", help="a GPN folder (save_pretrained / gpn train / gpn convert output) with safetensors weights"
    )
    parser.add_argument("repo_id", help="the Hub repo, 'owner/name' (created if missing)")
    parser.add_argument(
        "--private", action="store_true", help="create the repo as private (an existing repo keeps its visibility)"
    )
    parser.add_argument("--revision", default=None, help="branch to push to, created if missing (None: main)")
    parser.add_argument(
        "--commit-message", default=None, help="commit message (None: 'Upload NAME (GPN) with gpn push')"
    )
    parser.add_argument(
        "--token",
        default=None,
        help="Hub token with write access (None: $HF_TOKEN or the cached `hf auth login`; prefer those: a token "
        "on the command line lands in shell history). Never printed or written.",
    )
    parser.add_argument("--create-pr", action="store_true", help="open a pull request instead of committing directly")
    parser.add_argument(
        "--dry-run",
        metavar="OUT",
        default=None,
        help="write the exact folder that would be uploaded to OUT and stop (no network)",
    )
    parser.add_argument("--license", default="mit", help="license in the card's metadata (a Hub license id)")
    parser.add_argument(
        "--dataset",
        action="append",
        default=[],
        help="Hub dataset id the model was trained on, for the card's metadata (nothing is read, unlike gpn train "
        "--dataset; repeatable; added to those the training log names)",
    )
    parser.add_argument("--tag", action="append", default=[], help="extra tag for the card's metadata (repeatable)")
    parser.add_argument(
        "--model-name", default=None, help="name in the card's title and model-index (None: the repo name)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer name or path to publish (None: MODEL_DIR's own; given, it replaces it)",
    )
    parser.add_argument(
        "--base-model",
        metavar="REPO_ID",
        default=None,
        help="the Hub model this one was fine-tuned or merged from, for the card's base_model (None: the base_model "
        "of a README.md that a Trainer or TRL wrote into MODEL_DIR, if any)",
    )
    parser.add_argument(
        "--eval-results",
        metavar="FILE",
        default=None,
        help="gpn eval's eval_results.json for the card and its model-index (None: MODEL_DIR/eval_results.json if "
        "there is one; gpn eval writes ./eval-NAME/ unless told --output-dir MODEL_DIR)",
    )


def run(args: argparse.Namespace) -> int:
    """Run `gpn push`: check the folder, prepare it and upload it; returns the exit status."""
    try:
        push_folder(
            args.model_dir,
            args.repo_id,
            private=args.private,
            revision=args.revision,
            commit_message=args.commit_message,
            token=args.token,
            create_pr=args.create_pr,
            dry_run=args.dry_run,
            license=args.license,
            datasets=args.dataset,
            tags=args.tag,
            model_name=args.model_name,
            tokenizer=args.tokenizer,
            eval_results=args.eval_results,
            base_model=args.base_model,
        )
    except (HubPushError, CardError) as error:
        print(f"gpn push: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader went away (`gpn push ... | head`), no Hub: `gpn` stops quietly
        raise
    except Exception as error:  # noqa: BLE001 - network / auth errors from huggingface_hub
        if isinstance(error, unreachable_hub_errors()):
            message = str(error)
            for secret in token_values(args.token):
                message = message.replace(secret, "***")
            print(f"gpn push: the Hub refused or could not be reached: {message}", file=sys.stderr)
            return 1
        raise
    return 0
