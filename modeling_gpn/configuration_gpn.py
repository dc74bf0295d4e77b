"""Configuration of a Grounded Prediction Network (GPN).

This file ships to the Hugging Face Hub beside `modeling_gpn.py` (remote code), so it imports nothing
from the installed `modeling_gpn` package.
"""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

# The head shape of an attention model, which tools made for attention caches read from a config (`GPNConfig.__getattr__`).
_ATTENTION_SHAPE_ATTRIBUTES = frozenset({"num_attention_heads", "num_key_value_heads", "head_dim"})


class GPNConfig(PreTrainedConfig):
    r"""
    Configuration of a GPN ("A Single-Layer Model Can Do Language Modeling", arXiv 2605.10643).

    A GPN keeps one state vector of width `hidden_size` and, with `use_memory`, one matrix memory of
    `num_memory_heads` heads of `memory_key_dim` x `memory_value_dim` cells, shared by all
    `num_predict_layers` predict layers. The three variants of the paper are:

    - GPN (no memory): `use_memory=False`, `num_predict_layers=1`;
    - GPN+M: `use_memory=True`, `num_predict_layers=1`;
    - L-layer GPN+M: `use_memory=True`, `num_predict_layers=L`.

    Args:
        vocab_size: number of tokens; the embedding is tied to the output through a d -> e projection.
        hidden_size: width d of the state vector.
        embedding_size: width e of the token embedding.
        intermediate_size: hidden width of each predict layer's SwiGLU FFN.
        num_predict_layers: predict layers applied one after the other inside each step.
        use_memory: whether the model has the gated delta-rule matrix memory (GPN+M).
        num_memory_heads: memory heads H.
        memory_key_dim: key width dk of each head.
        memory_value_dim: value width dv of each head.
        use_decoder_bias: add a bias after the d -> e decoder projection (part of the base model's output,
            `GPNModel(...).last_hidden_state`, which the tied output matrix multiplies).
        rms_norm_eps: epsilon inside every RMSNorm's square root (the reference uses 1e-6).
        initializer_range: std of the embedding and of the memory read output matrix at initialisation.
        bptt_segment_length: training keeps the state only every this many tokens and recomputes inside
            segments (memory-bounded BPTT); `None` stores every step.
        bptt_truncation_length: stop the gradient through the state every this many tokens (the paper's
            2-layer model used 512); `None` backpropagates through the whole window.
        max_length_hint: the window length the model was trained on; evaluation tools use it as the
            default context length (a GPN itself has no positional limit).
        tie_word_embeddings: always True: a GPN's output matrix is its token embedding (`lm_head.weight` is
            `model.embed_tokens.weight`). Configs saved before the output head was a module say False, which
            meant the same tied model; any value given or assigned is read as True.
    """

    model_type = "gpn"
    # lm-eval looks for a context length under `n_positions` first; a GPN has no positional limit, so the
    # training window serves as its default. Not under `max_position_embeddings`: generate() reads that one
    # as a hard limit (a default-length call on a longer prompt raised, longer outputs warned), and a GPN
    # continues past its training window like any recurrent model. Given as an argument it still sets
    # `max_length_hint` (`__post_init__`).
    attribute_map = {"num_hidden_layers": "num_predict_layers", "n_positions": "max_length_hint"}

    vocab_size: int = 32000
    hidden_size: int = 2496
    embedding_size: int = 768
    intermediate_size: int = 6656
    num_predict_layers: int = 1
    use_memory: bool = True
    num_memory_heads: int = 15
    memory_key_dim: int = 128
    memory_value_dim: int = 256
    use_decoder_bias: bool = False
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    bptt_segment_length: int | None = None
    bptt_truncation_length: int | None = None
    max_length_hint: int | None = 2048
    use_cache: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    tie_word_embeddings: bool = True

    def __setattr__(self, key: str, value: object):
        if key == "tie_word_embeddings":
            # A GPN has no untied variant (logits = (W_dec rms(p) + b) E^T); older configs stored False for it.
            value = True
        super().__setattr__(key, value)

    def __post_init__(self, **kwargs):
        if "max_position_embeddings" in kwargs:  # (the name this hint had before; not kept as an attribute)
            self.max_length_hint = kwargs.pop("max_position_embeddings")
        self._check_values()
        super().__post_init__(**kwargs)

    def _check_values(self, token_ids: bool = True) -> None:
        """Raise one clear error for any value a GPN cannot be built with, and (`token_ids`) for special token ids
        the vocabulary lacks. A model checks only the former when it is built: resizing the vocabulary changes
        `vocab_size` before the ids can follow, and transformers builds models from such configs."""
        problems = []

        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")

        def number(name: str, value: object, positive: bool) -> None:
            # finite: an infinite eps zeroes every RMSNorm, an infinite std fills every weight with NaN
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value!r}")
            elif value < 0 or (positive and value == 0):
                problems.append(f"{name} must be {'positive' if positive else 'non-negative'}, got {value!r}")

        for name in ("use_memory", "use_decoder_bias"):
            # A hand-edited config.json's "false" (a string) is truthy: it would build the memory or the bias, and
            # a checkpoint without them would load with those weights drawn at random.
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("vocab_size", "hidden_size", "embedding_size", "intermediate_size", "num_predict_layers"):
            positive_int(name, getattr(self, name))
        if self.use_memory:
            for name in ("num_memory_heads", "memory_key_dim", "memory_value_dim"):
                positive_int(name, getattr(self, name))
        for name in ("bptt_segment_length", "bptt_truncation_length", "max_length_hint"):
            value = getattr(self, name)
            if value is not None:
                positive_int(name, value)
        number("rms_norm_eps", self.rms_norm_eps, positive=True)
        number("initializer_range", self.initializer_range, positive=False)
        vocab_size = self.vocab_size
        if token_ids and isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > 0:
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                # An id the embedding has no row for: generate() would never stop on such an eos, and would feed
                # such a pad back in to finished rows. (transformers only warns, for Hub configs storing -1.)
                value = getattr(self, name)
                ids = value if isinstance(value, (list, tuple)) and name == "eos_token_id" else [value]
                if value is not None and not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
                ):
                    problems.append(f"{name} must be None or a token id below vocab_size ({vocab_size}), got {value!r}")
        if problems:
            raise ValueError("Invalid GPNConfig: " + "; ".join(problems))

    def validate(self) -> None:
        """transformers' strict validation, which `save_pretrained` runs before writing config.json, with this
        config's own checks: transformers calls its own class validators (`PreTrainedConfig.validate_*`), never
        an override of one, so a value set after construction (`config.update`, an attribute) would otherwise be
        saved unchecked."""
        super().validate()
        self._check_values()

    def __getattr__(self, name: str):
        """Called only for an attribute the config lacks: an attention model's head shape is refused by name (still
        an AttributeError, so `getattr(config, name, default)` and `hasattr` answer as before). Tools made for
        attention caches read it: transformers' `StaticCache` and the ExecuTorch exporters of
        `transformers.integrations.executorch`, which build one, failed deep inside transformers with a bare "no
        attribute 'num_attention_heads'"."""
        if name in _ATTENTION_SHAPE_ATTRIBUTES:
            raise AttributeError(
                f"{type(self).__name__} has no {name}: a GPN has no attention layers (its cache is one recurrent "
                "state a row, a GPNCache), so tools made for attention key-value caches do not apply: transformers' "
                "StaticCache, and the ExecuTorch exporters of transformers.integrations.executorch, which build one. "
                "generate() takes cache_implementation='static' (a GPNCache); torch.export.export takes a GPN whose "
                "forward is given and returns its GPNCache (docs/transformers.md, 'torch.compile and torch.export')"
            )
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    @property
    def memory_cells(self) -> int:
        """Number of cells in the matrix memory (0 without memory)."""
        if not self.use_memory:
            return 0
        return self.num_memory_heads * self.memory_key_dim * self.memory_value_dim

    @property
    def state_floats_per_row(self) -> int:
        """Floats the recurrent cache holds per sequence: p and g (d each) plus the memory."""
        return 2 * self.hidden_size + self.memory_cells


__all__ = ["GPNConfig"]
