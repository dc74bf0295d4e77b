"""transformers' serving model manager, able to build a GPN.

`transformers serve` builds every model with `getattr(transformers, config.architectures[0])`, so it stops at
start-up on a GPN (`module transformers has no attribute GPNForCausalLM`): the Auto classes' registry, where
`import modeling_gpn` registers GPN, is not consulted. The model manager's module holds its own reference to
the `transformers` module; `gpn serve` points it at `TransformersWithGPN`, transformers as it is with GPN's
classes beside its own, and leaves the model manager's code (loading, dtype, device map, quantization,
the idle timeout) as transformers wrote it, a GPN's weights checked as the other commands check them
(`CheckedGPNForCausalLM`). A server pinned to one model loads no other (`load_only_the_pinned_model`).
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import transformers
from fastapi import HTTPException
from transformers.cli.serving import model_manager
from transformers.cli.serving.utils import split_model_id, split_revision

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

from .. import GPNForCausalLM, GPNModel


class CheckedGPNForCausalLM:
    """`GPNForCausalLM` as the serving model manager builds it (`from_pretrained`, its only use), with the weights
    checked as gpn eval, inspect and generate check theirs (`causal_lm_from_pretrained`): weights the files lack
    were drawn at random and served as the model named, and weights holding NaN failed every request (generate()'s
    check of the logits) instead of the load."""

    @staticmethod
    def from_pretrained(model_id: str, **kwargs) -> GPNForCausalLM:
        """Load `model_id` as `causal_lm_from_pretrained` does (damaged or non-finite weights refused)."""
        from ..cli.loading import causal_lm_from_pretrained

        return causal_lm_from_pretrained(model_id, **kwargs)


GPN_CLASSES = {"GPNForCausalLM": CheckedGPNForCausalLM, "GPNModel": GPNModel}


def refuse_quantized_adapter(model_id: str, quantization: str | None) -> None:
    """A `ValueError` where the model `model_id` is a local PEFT adapter folder and `--quantization` is given: merged
    into 4- or 8-bit weights, the adapter would be rounded away, and the model served would not be the merged one.
    (`gpn serve ADAPTER` checks it with its arguments; a server not pinned, when a request names the adapter.)"""
    from ..cli.loading import adapter_base

    if quantization is not None and adapter_base(model_id) is not None:
        raise ValueError(
            f"{model_id} is a PEFT adapter: --quantization applies to a whole model; merge the adapter "
            "(PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(folder)) and serve that"
        )


def refuse_two_quantizations(dtype: str | None, quantization: str | None) -> None:
    """A `ValueError` where `--dtype int8 | int4` (torchao's quantization, `gpn serve --dtype`) and `--quantization`
    (transformers serve's bitsandbytes) are both given: each quantizes the model, and torchao cannot quantize
    bitsandbytes' layers."""
    if dtype in ("int8", "int4") and quantization is not None:
        raise ValueError(f"--dtype {dtype} and --quantization {quantization} are two quantizations: give one")


class GPNModelManager(model_manager.ModelManager):
    """transformers' serving model manager, able to load a local PEFT adapter folder as the other `gpn` commands
    do (`cli.loading.load_causal_lm`): its base with the adapter merged, and the adapter folder's tokenizer, else
    the base's. transformers' own reads the folder's config.json, which an adapter folder has not. The model is
    the merged one, so the state store keeps its states under its own weights (`state_store.model_key`), apart
    from a server of the base's."""

    quantize_to: str | None = None  # "int8", "int4": each model loaded is quantized so (`quantizing_model_manager`)
    # called with each GPN loaded and its name, to refuse it (a ValueError) where the state store cannot keep its
    # states (`StateStore.refuse_a_model_over_the_folder_bound`: known exactly only once loaded)
    check_loaded: Callable[[torch.nn.Module, str], None] | None = None

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        from ..cli.loading import adapter_base, end_of_text_disagreement, tokenizer_source

        model_id, _ = split_revision(model_id_and_revision)
        if gguf_file is None and adapter_base(model_id) is not None:
            processor = super()._load_processor(self.process_model_name(tokenizer_source(model_id)))
        else:
            processor = super()._load_processor(model_id_and_revision, gguf_file=gguf_file)
        tokenizer = getattr(processor, "tokenizer", processor)  # (a multimodal processor holds its tokenizer)
        if gguf_file is None and getattr(tokenizer, "eos_token_id", None) is not None:
            # Refused as gpn generate and gpn push refuse it: every answer would run past its end of text, or stop
            # at an ordinary token with finish_reason "stop". (A pinned model at startup; otherwise, the request.)
            disagreement = end_of_text_disagreement(model_id, tokenizer)
            if disagreement is not None:
                raise ValueError(disagreement)
        return processor

    def _load_model(
        self,
        model_id_and_revision: str,
        tqdm_class: type | None = None,
        progress_callback: Callable | None = None,
        gguf_file: str | None = None,
    ):
        from ..cli.loading import adapter_base, load_causal_lm

        model_id, _ = split_revision(model_id_and_revision)
        if gguf_file is not None or adapter_base(model_id) is None:
            model = super()._load_model(model_id_and_revision, tqdm_class, progress_callback, gguf_file)
        else:
            refuse_quantized_adapter(model_id, self.quantization)  # (a server not pinned: the request's model)
            model = load_causal_lm(
                model_id,
                dtype=self.dtype,
                device_map=self.device,
                attn_implementation=self.attn_implementation,
                trust_remote_code=self.trust_remote_code,
                tqdm_class=tqdm_class,
            )
        if self.quantize_to is not None:
            from ..cli.quantization import quantize_for

            # (as gpn generate --dtype int8 | int4: the bfloat16 model quantized, a folder saved so served as saved,
            # another quantization refused in one line)
            model = quantize_for(model, self.quantize_to, model_id)
        if self.check_loaded is not None and isinstance(model, (GPNForCausalLM, GPNModel)):
            self.check_loaded(model, model_id)  # (a pinned model at startup; otherwise, the request)
        return model


def quantizing_model_manager(
    kind: str | None, check_loaded: Callable[[torch.nn.Module, str], None] | None = None
) -> type[GPNModelManager]:
    """`GPNModelManager`, each model it loads quantized to `kind` ("int8", "int4": `gpn serve --dtype int8 | int4`,
    through `cli.quantization.quantize_for`), or as it is for None, and each GPN loaded checked by `check_loaded`."""
    if kind is None and check_loaded is None:
        return GPNModelManager
    attributes = {"quantize_to": kind, "check_loaded": None if check_loaded is None else staticmethod(check_loaded)}
    return type(GPNModelManager.__name__, (GPNModelManager,), {**attributes, "__module__": __name__})


class TransformersWithGPN(types.ModuleType):
    """The `transformers` module, with GPN's model classes found by name too."""

    def __init__(self):
        super().__init__(transformers.__name__, transformers.__doc__)

    def __getattr__(self, name: str):
        if name in GPN_CLASSES:
            return GPN_CLASSES[name]
        return getattr(transformers, name)


def make_gpn_loadable() -> None:
    """Point transformers' serving model manager at `TransformersWithGPN` (idempotent; for this process)."""
    if not isinstance(model_manager.transformers, TransformersWithGPN):
        model_manager.transformers = TransformersWithGPN()


def load_only_the_pinned_model(manager: model_manager.ModelManager) -> None:
    """On a server pinned to one model (`force_model`), `POST /load_model` naming another is a 400. transformers'
    endpoint loaded any model it was given and kept it for good (a pinned server's idle timeout is off), while
    every request for it was refused: memory taken for nothing, once for each name a client sent."""
    if manager.force_model is None:
        return
    repo, pinned_gguf_file = split_model_id(manager.force_model)
    pinned = (manager.process_model_name(repo), pinned_gguf_file)
    load = manager.load_model_streaming

    def load_model_streaming(model_id_and_revision: str, gguf_file: str | None = None):
        # (called by the endpoint before its response begins: raised here, the refusal is the answer's status)
        if (model_id_and_revision, gguf_file) != pinned:
            raise HTTPException(
                status_code=400,
                detail=f"this server is pinned to {manager.force_model!r}: it loads no other model "
                f"({model_id_and_revision!r})",
            )
        return load(model_id_and_revision, gguf_file=gguf_file)

    manager.load_model_streaming = load_model_streaming
