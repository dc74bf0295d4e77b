"""Conversion of the reference JAX implementation's checkpoints (installed as `modeling_gpn.conversion`)."""

from .reference import CheckpointError, RestrictedUnpickler, convert, infer_config, load_reference_model, read_source

__all__ = ["CheckpointError", "RestrictedUnpickler", "convert", "infer_config", "load_reference_model", "read_source"]
