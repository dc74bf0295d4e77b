"""`gpn generate MODEL PROMPT...`: text from a model folder or Hub repo with transformers' generate()."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from ..cache import GPNCache

from .arguments import ADAPTER_FOLDER_HELP
from .text_stream import StreamText, continuation

DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "int4")
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95


class GenerateError(ValueError):
    """A bad argument or a model/tokenizer that cannot be used; the message says which."""


def sampling_setting(model: PreTrainedModel, name: str, given: float | None, default: float) -> float:
    """`--temperature` / `--top-p` for sampling: as given, else the model's own (what its generation_config.json sets,
    its authors' choice, which `model.generate(do_sample=True)` uses too), else this command's default."""
    if given is not None:
        return given
    own = model.generation_config.to_diff_dict().get(name)
    return own if own is not None else default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn generate`."""
    parser.add_argument(
        "model",
        help=f"model folder, Hub repo id, or {ADAPTER_FOLDER_HELP}",
    )
    parser.add_argument(
        "prompts",
        nargs="+",
        help="one or more prompts (batched with left padding); - reads one from standard input (a file: < FILE)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the model's own)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature (> 0; with --sample, default: the model's generation_config.json's, else "
        f"{DEFAULT_TEMPERATURE})",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling mass (in (0, 1]; with --sample, default: the model's generation_config.json's, else "
        f"{DEFAULT_TOP_P})",
    )
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (>= 1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (0 to 2**64 - 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights: as saved (auto), float32, bfloat16, float16 (GPUs without bf16; a weight past float16's range "
        "is refused), int8 or int4 (torchao's int8 weight-only / int4 weight-only quantization of every nn.Linear of "
        "the bfloat16 model but the tied head; needs torchao; on CPU the fast path runs int8 on its int8 kernels, int4 "
        "on the matrices it dequantizes to)",
    )
    parser.add_argument("--trust-remote-code", action="store_true", help="load the model's own code (Hub repos)")
    parser.add_argument(
        "--no-stream",
        dest="stream",
        action="store_false",
        help="print the text once it is all generated (by default one prompt's text is printed as it is generated; "
        "several prompts and beam search always print at the end)",
    )
    parser.add_argument(
        "--save-state",
        metavar="FILE",
        default=None,
        help="write the state after each prompt and its generated text to FILE (safetensors), to continue with "
        "--state (a GPN only)",
    )
    parser.add_argument(
        "--state",
        metavar="FILE",
        default=None,
        help="continue after the state in FILE (from --save-state): the prompts are text that follows it",
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments that generate() would reject with a traceback, or silently ignore."""
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.num_beams < 1:
        raise GenerateError(f"--num-beams must be at least 1, got {args.num_beams}")
    if not 0 <= args.seed < 2**64:  # torch.manual_seed's range (above it: "Overflow when unpacking long long")
        raise GenerateError(f"--seed must be >= 0 and below 2**64, got {args.seed}")
    if not args.sample:
        given = [
            name for name, value in (("--temperature", args.temperature), ("--top-p", args.top_p)) if value is not None
        ]
        if given:  # greedy and beam decoding ignore them: say so instead of ignoring them in silence
            verb = "applies" if len(given) == 1 else "apply"
            raise GenerateError(f"{' and '.join(given)} only {verb} with --sample (decoding is greedy without it)")
    if args.temperature is not None and not 0 < args.temperature < math.inf:  # inf: every token equally likely
        raise GenerateError(f"--temperature must be > 0 and finite, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")
    # "~/x" quoted (or from a script) arrives unexpanded: read and written as the model argument's is, at home
    args.state = None if args.state is None else str(Path(args.state).expanduser())
    args.save_state = None if args.save_state is None else str(Path(args.save_state).expanduser())
    if args.state is not None:
        if not Path(args.state).is_file():
            raise GenerateError(f"--state {args.state} is not a file")
        if args.num_beams > 1:
            raise GenerateError("--num-beams above 1 cannot continue from --state yet: use greedy decoding or --sample")
    if args.save_state is not None:
        folder = Path(args.save_state).resolve().parent
        if not folder.is_dir():
            raise GenerateError(f"--save-state {args.save_state}: its folder does not exist")
        if Path(args.save_state).exists() and not Path(args.save_state).is_file():
            raise GenerateError(f"--save-state {args.save_state} is not a file (a folder, device or pipe)")
        from modeling_gpn.cli.arguments import writable_folder
        from modeling_gpn.state_file import GPNStateFileError, check_replaceable

        try:  # (a read-only folder failed only after generating, at the save)
            writable_folder(folder, "--save-state")
        except ValueError as error:
            raise GenerateError(str(error)) from None
        try:  # (the model's weights, named by mistake, were replaced by the state once it was generated)
            check_replaceable(args.save_state)
        except GPNStateFileError as error:
            raise GenerateError(f"--save-state: {error}") from None
    for index, prompt in enumerate(args.prompts, start=1):
        if not prompt.strip():
            raise GenerateError(f"prompt {index} is empty: give some text to continue")
        try:  # (bytes the locale cannot decode arrive as lone surrogates; the tokenizer refused them with a TypeError)
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise GenerateError(
                f"prompt {index} holds bytes that are not text in this locale's encoding ({sys.getfilesystemencoding()}): "
                "run with a UTF-8 locale (LANG=C.UTF-8) or PYTHONUTF8=1"
            ) from None
    from modeling_gpn.cli.arguments import torch_device

    try:
        torch_device(args.device)
    except ValueError as error:
        raise GenerateError(str(error)) from None
    from modeling_gpn.cli.loading import check_model_path

    try:
        args.model = check_model_path(args.model)
    except FileNotFoundError as error:
        raise GenerateError(str(error)) from None


def _load(args: argparse.Namespace):
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)
    from modeling_gpn.cli.loading import (
        BaseModelNotFoundError,
        adapter_note,
        end_of_text_disagreement,
        load_causal_lm,
        load_model_tokenizer,
    )
    from modeling_gpn.data import DataError

    note = adapter_note(args.model, args.tokenizer)
    if note is not None:  # (which base, and whose tokenizer: what the text comes from)
        print(f"gpn generate: {note}", file=sys.stderr)
    source = args.tokenizer or args.model
    try:
        tokenizer = load_model_tokenizer(args.model, args.tokenizer, require_eos=False)
    except DataError as error:  # any loader failure, as one clear message
        raise GenerateError(str(error)) from error
    disagreement = end_of_text_disagreement(args.model, tokenizer)
    if disagreement is not None:  # (the text printed would run past its end, or stop at an ordinary token)
        raise GenerateError(disagreement)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None and len(args.prompts) > 1:
            raise GenerateError(
                f"the tokenizer of {source} has neither a pad nor an EOS token to pad a batch of prompts with"
            )
        tokenizer.pad_token = tokenizer.eos_token
    # (as gpn eval and gpn inspect load: weights drawn at random where the files lack them gave text from another
    # model than the one named, without a word; NaN weights are named at load; an adapter merged into its base)
    try:
        model = load_causal_lm(args.model, trust_remote_code=args.trust_remote_code)
    except (ValueError, BaseModelNotFoundError) as error:  # (its own refusals, transformers' naming the problem)
        raise GenerateError(str(error)) from None
    except Exception as error:  # noqa: BLE001
        raise GenerateError(f"cannot load a model from {args.model}: {type(error).__name__}: {error}") from error
    return model, tokenizer


def _to_dtype(model: PreTrainedModel, dtype: str, source: str = "the model"):
    """The model in `--dtype` (auto: as loaded; a float dtype cast, a weight it makes inf refused naming the dtype,
    as gpn eval's and gpn inspect's loads refuse one). int8 and int4 quantize every nn.Linear of the bfloat16 model with
    torchao's weight-only configs, as `gpn bench` and `gpn eval` do (`cli.quantization.quantize_for`: the output head,
    tied to the embedding, stays bfloat16; a model saved quantized already is kept when of that kind, refused
    otherwise)."""
    if dtype == "auto":
        return model
    if dtype in ("float32", "bfloat16", "float16"):
        from modeling_gpn.cli.loading import refuse_non_finite_parameters

        model = model.to(getattr(torch, dtype))
        try:  # (the load refused non-finite weights: one here is one the cast made, past float16's range)
            refuse_non_finite_parameters(model, source)
        except ValueError as error:
            hint = "; float16's largest value is 65504: use --dtype bfloat16 or float32" if dtype == "float16" else ""
            raise GenerateError(f"{error}{hint}") from None
        return model
    from modeling_gpn.cli.quantization import quantize_for

    try:  # (gpn eval --dtype int8 | int4 quantizes through the same function)
        return quantize_for(model, dtype, source)
    except ValueError as error:
        raise GenerateError(str(error)) from None


def _check_saves_a_state(args: argparse.Namespace, model: PreTrainedModel) -> None:
    """Refuse `--save-state` for a model that keeps no GPN state (a Llama's cache is its keys and values), before
    anything is generated (it failed with a traceback after generating)."""
    from modeling_gpn.state_file import gpn_base_model

    if args.save_state is None:
        return
    try:
        gpn_base_model(model)
    except TypeError:
        raise GenerateError(
            f"--save-state needs a GPN model (a state of fixed size to save); {args.model} is a {type(model).__name__}"
        ) from None


def _load_state(args: argparse.Namespace, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, num_prompts: int):
    """The `--state` file's cache, with one row per prompt (a one-row state is forked to every prompt)."""
    from modeling_gpn.modeling_gpn import GPNCache, GPNStateFileError

    try:
        state = GPNCache.load(args.state, model, tokenizer=tokenizer)
    except (GPNStateFileError, TypeError) as error:
        raise GenerateError(str(error)) from error
    rows = state.state_layer.batch_size
    if rows == num_prompts:
        return state
    if rows == 1:
        return state.fork(num_prompts)
    raise GenerateError(f"--state {args.state} holds {rows} rows (prompts); give {rows} prompts, or one state row")


def _text_mask(
    prompt_mask: torch.Tensor, generated: torch.Tensor, eos_token_id: int | list[int] | None
) -> torch.Tensor:
    """The mask of the text each row holds: its prompt, and its generated tokens up to its first EOS.

    generate() pads a row that ended (EOS) while others go on; that padding is not part of its text.
    """
    generated_mask = torch.ones_like(generated, dtype=prompt_mask.dtype)
    if eos_token_id is not None:
        eos_ids = torch.as_tensor(eos_token_id, device=generated.device).reshape(-1)
        is_eos = torch.isin(generated, eos_ids).long()
        generated_mask = ((is_eos.cumsum(dim=1) - is_eos) == 0).to(prompt_mask.dtype)
    return torch.cat([prompt_mask, generated_mask], dim=1)


def _save_state(
    args: argparse.Namespace,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    start: GPNCache | None,
    output: torch.Tensor,
    text_mask: torch.Tensor,
    continued: os.stat_result | None = None,
) -> None:
    """Write the state after `start` (a cache, or None for the empty state) and every row's text, naming the
    tokenizer whose ids it read (a later `--state` with another tokenizer is refused). `continued`: the `--state`
    file as it was read, when this save replaces it: refused if another process replaced it meanwhile."""
    from ..atomic_files import unchanged_since

    read_before = start.get_seq_length() if start is not None else 0
    if read_before:
        text_mask = torch.cat([text_mask.new_ones(text_mask.shape[0], read_before), text_mask], dim=1)
    with torch.no_grad():  # a no-grad forward keeping one logit runs in bounded memory, whatever the length
        state = model(output, attention_mask=text_mask, cache=start, use_cache=True, logits_to_keep=1).cache
    if not unchanged_since(args.save_state, continued):
        raise GenerateError(
            f"--save-state {args.save_state} was replaced by another process since this run read it as --state: "
            "not overwritten (the other process's state would be lost in silence). The text above continues the "
            "state this run read; give another --save-state to keep this run's state too"
        )
    try:
        state.save(args.save_state, tokenizer=tokenizer)
    except OSError as error:
        raise GenerateError(f"cannot write --save-state {args.save_state}: {error.strerror or error}") from error
    print(f"state after {state.get_seq_length()} positions written to {args.save_state}", file=sys.stderr)


def read_stdin_prompt(prompts: list[str]) -> list[str]:
    """`prompts` with a `-` replaced by standard input's text, less the one newline that ends a file or an
    `echo` (as the shell's `$(cat FILE)` drops it): a prompt too long for the command line, or with quotes."""
    if prompts.count("-") > 1:
        raise GenerateError("- (a prompt from standard input) can be given once")
    if "-" not in prompts:
        return prompts
    if sys.stdin is None:  # (started with standard input closed, `<&-`: reading it failed with an AttributeError)
        raise GenerateError("- reads the prompt from standard input, which is closed: give the prompt, or < FILE")
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    return [text if prompt == "-" else prompt for prompt in prompts]


def _hold_saved_state(args: argparse.Namespace, holds: contextlib.ExitStack) -> os.stat_result | None:
    """Hold the `--save-state` file, where there is one already, until the state is written (`atomic_files.held`),
    so that a second `gpn generate` saving there meanwhile is refused at its start, naming this one. Two processes
    continuing one state (`--state F --save-state F`) each read F and then replaced it: the later save dropped
    the earlier one's turn in silence. Returns what is held when it is also the `--state` file (continued: the
    save checks it was not replaced meanwhile by a writer that does not hold it), else None."""
    from ..atomic_files import InUseError, held

    # (`check_arguments` expanded a leading ~ of both paths)
    if args.save_state is None or not Path(args.save_state).is_file():
        return None
    try:
        seen = holds.enter_context(
            held(
                Path(args.save_state),
                "that continues or writes the state in it (gpn generate --save-state)",
                "wait for it to end, or give this run another --save-state",
            )
        )
    except InUseError as error:
        raise GenerateError(f"--save-state {error}") from error
    continued = args.state is not None and os.path.samefile(args.state, args.save_state)
    return seen if continued else None


def run(args: argparse.Namespace) -> int:
    """Run `gpn generate`: load the model, generate for each prompt and print; returns the exit status."""
    with contextlib.ExitStack() as holds:
        return _run(args, holds)


def _run(args: argparse.Namespace, holds: contextlib.ExitStack) -> int:
    try:
        args.prompts = read_stdin_prompt(args.prompts)
        check_arguments(args)
        continued = _hold_saved_state(args, holds)
        model, tokenizer = _load(args)
        model.to(args.device).eval()
        model = _to_dtype(model, args.dtype, args.model)
        _check_saves_a_state(args, model)
        if args.state is None:
            batch = tokenizer(args.prompts, return_tensors="pt", padding=True)
        else:  # text that continues a state: no BOS in front, and tokenized as the middle of a text (continuation_ids)
            from modeling_gpn.data import continuation_ids

            batch = tokenizer.pad({"input_ids": continuation_ids(tokenizer, args.prompts)}, return_tensors="pt")
        batch = batch.to(args.device)
        if batch["input_ids"].shape[1] == 0:
            raise GenerateError("the prompts tokenize to no tokens at all")
        vocab = model.get_input_embeddings().num_embeddings
        if int(batch["input_ids"].max()) >= vocab:
            raise GenerateError(
                f"the tokenizer makes token id {int(batch['input_ids'].max())}, outside the model's vocabulary of {vocab}: "
                "is --tokenizer the model's own?"
            )
        prompt_mask = batch["attention_mask"]
        start = _load_state(args, model, tokenizer, len(args.prompts)) if args.state is not None else None
        generation_inputs = dict(batch)
        if start is not None:  # the new tokens, with a mask covering the positions the state has read
            read = start.get_seq_length()
            generation_inputs["attention_mask"] = torch.cat(
                [prompt_mask.new_ones(prompt_mask.shape[0], read), prompt_mask], 1
            )
            generation_inputs["cache"] = start.fork(1)  # generate() advances its cache; `start` stays for --save-state
        prompt_width = batch["input_ids"].shape[1]
        streamer = None
        if args.stream and len(args.prompts) == 1 and args.num_beams == 1:  # (transformers streams one row, no beams)
            streamer = PrintingStreamer(tokenizer, batch["input_ids"][0], args.prompts[0])
        torch.manual_seed(args.seed)
        with torch.no_grad():
            output = model.generate(
                streamer=streamer,
                **generation_inputs,
                max_new_tokens=args.max_new_tokens,
                do_sample=args.sample,
                temperature=sampling_setting(model, "temperature", args.temperature, DEFAULT_TEMPERATURE)
                if args.sample
                else None,
                top_p=sampling_setting(model, "top_p", args.top_p, DEFAULT_TOP_P) if args.sample else None,
                num_beams=args.num_beams,
                pad_token_id=tokenizer.pad_token_id,
            )
    except GenerateError as error:  # a bad argument: one line worded as argparse words its own
        print(f"gpn generate: error: {error}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError) as error:  # generate() refusing the combination it was given
        print(f"gpn generate: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    for prompt, row, mask in zip(args.prompts, output, prompt_mask):
        prompt_ids = row[:prompt_width][mask.bool()]
        if streamer is None:
            print(f"{prompt}{continuation(tokenizer, prompt_ids, row[prompt_width:])}")
        else:  # what was not printed yet (text held back at the end, or where the whole decodes otherwise)
            print(streamer.rest(continuation(tokenizer, prompt_ids, row[prompt_width:])))
        print("-" * 40)
    # The state is written after the text is printed: a save that fails (a disk that filled meanwhile) loses
    # only the state, never the generated text (saved first, a failed save had lost the text with it).
    if args.save_state is not None:
        sys.stdout.flush()
        try:
            text_mask = _text_mask(prompt_mask, output[:, prompt_width:], model.generation_config.eos_token_id)
            _save_state(args, model, tokenizer, start, output, text_mask, continued)
        except GenerateError as error:
            print(f"gpn generate: error: {error}", file=sys.stderr)
            return 2
        except (ValueError, TypeError, RuntimeError) as error:  # the save refusing the state (GPNCache.save)
            print(f"gpn generate: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 0


class PrintingStreamer:
    """A generate() streamer (transformers' `put` / `end`) that prints one prompt's continuation as its tokens come:
    the prompt first, then each piece of text that `StreamText` gives, flushed: decoded after the last few prompt
    tokens (decoding the new tokens alone loses a SentencePiece word's space), text ending in an unfinished
    character (a byte token's replacement character) or in a run of byte tokens held until the token that completes
    it. `rest` gives what the finished text adds."""

    CONTEXT = 8  # prompt tokens decoded before the new ones: enough for a piece's space or a byte sequence

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: torch.Tensor, prompt: str):
        context = character_aligned_context(tokenizer, prompt_ids, self.CONTEXT)
        self.text = StreamText(tokenizer, skip_special_tokens=True, context=context.tolist())
        self.prompt, self.printed, self.prompt_seen = prompt, "", False

    def put(self, ids: torch.Tensor) -> None:
        """Print the prompt on the first call (generate() puts it first), then each new piece of text."""
        if not self.prompt_seen:  # generate() puts the prompt's ids first
            self.prompt_seen = True
            sys.stdout.write(self.prompt)
            sys.stdout.flush()
            return
        piece = self.text.step(self.text.tokenizer, ids.reshape(-1).tolist())
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
            self.printed += piece

    def end(self) -> None:
        """Nothing to do: `put` printed each piece as it came (`rest` gives what the finished text adds)."""
        pass

    def rest(self, whole: str) -> str:
        """What `whole` (the finished continuation) adds to what was printed; all of it, on a line of its own, in
        the rare case the printed pieces are not how the whole decodes."""
        return whole[len(self.printed) :] if whole.startswith(self.printed) else f"\n{self.prompt}{whole}"


def character_aligned_context(tokenizer: PreTrainedTokenizerBase, prompt_ids: torch.Tensor, size: int) -> torch.Tensor:
    """The last `size` prompt tokens, or up to 3 more: enough to begin on a whole character.

    The last `size` tokens can begin inside a character split over byte tokens (Llama 2's `<0xE9>`). A
    byte-fallback decoder turns a run of byte tokens that is not valid UTF-8 into one U+FFFD per byte, so a run cut
    at its start, and continued by the new tokens (a prompt and an answer in rare CJK characters or emoji),
    decoded as replacement characters all along: the stream printed them, then the whole text again. A character
    is at most 4 bytes, so at most 3 more tokens reach its first.
    """
    start = max(0, len(prompt_ids) - size)
    for _ in range(3):
        if start == 0 or not tokenizer.decode(prompt_ids[start:], skip_special_tokens=True).startswith("\ufffd"):
            break
        start -= 1
    return prompt_ids[start:]
