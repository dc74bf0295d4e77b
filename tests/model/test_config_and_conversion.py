"""GPNConfig validation, the presets, and `gpn convert` on good and bad checkpoints."""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from modeling_gpn import GPNConfig, GPNForCausalLM
from modeling_gpn.configuration import list_presets, load_preset, preset_path
from modeling_gpn.conversion import CheckpointError, load_reference_model

from ..environment import require_shared, small_disk
from ..subprocesses import started_in_the_background
from ..tiny_models import perturbed_model, tiny_config


def count_parameters(config: GPNConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPNForCausalLM(config).parameters())


# ---- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(hidden_size=0), "hidden_size"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(num_memory_heads=0), "num_memory_heads"),
        (dict(intermediate_size=2.5), "intermediate_size"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
        (dict(bptt_segment_length=0), "bptt_segment_length"),
    ],
)
def test_invalid_config_values_raise_clearly(bad, message):
    with pytest.raises(ValueError, match=message):
        GPNConfig(**bad)


@pytest.mark.parametrize(
    "bad, message",
    [
        # a hand-edited config.json's string is truthy: "false" built the memory (or the bias)
        pytest.param(dict(use_memory="false"), "use_memory must be true or false", id="use_memory-string"),
        pytest.param(dict(use_decoder_bias="no"), "use_decoder_bias must be true or false", id="decoder_bias-string"),
        # an infinite eps zeroed every RMSNorm; a negative std failed inside torch's initialiser
        pytest.param(dict(rms_norm_eps=float("inf")), "rms_norm_eps must be a finite number", id="eps-infinite"),
        pytest.param(dict(initializer_range=-0.02), "initializer_range must be non-negative", id="std-negative"),
        # ids the embedding has no row for: generate() never stopped on such an eos
        pytest.param(dict(eos_token_id=32000), "eos_token_id must be None or a token id below", id="eos-outside"),
        pytest.param(
            dict(eos_token_id=[2, 32000]), "eos_token_id must be None or a token id below", id="eoses-outside"
        ),
        pytest.param(dict(pad_token_id=-1), "pad_token_id must be None or a token id below", id="pad-outside"),
        pytest.param(
            dict(vocab_size=97, bos_token_id=97), "bos_token_id must be None or a token id below", id="bos-outside"
        ),
    ],
)
def test_values_a_gpn_would_misread_are_refused_naming_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        GPNConfig(**bad)


def edited_copy(folder, tmp_path, **values):
    """A copy of a saved model folder whose config.json has `values` written over it, as by hand."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, **values}))
    return copy


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(use_memory="false"), "use_memory must be true or false, got 'false'"),
        (dict(eos_token_id=500), "eos_token_id must be None or a token id below vocab_size \\(97\\), got 500"),
    ],
    ids=["use_memory", "eos_token_id"],
)
def test_a_hand_edited_config_json_is_refused_at_from_pretrained(tmp_path, values, message):
    """Such a config loaded: a memoryless checkpoint marked use_memory "false" came up with a memory drawn at random
    (only a load report said so), an eos the vocabulary lacks made generate() run to max_new_tokens."""
    folder = tmp_path / "saved"
    perturbed_model(tiny_config(use_memory=False)).save_pretrained(folder)
    edited = edited_copy(folder, tmp_path, **values)
    with pytest.raises(ValueError, match=message):
        AutoModelForCausalLM.from_pretrained(edited)


def test_a_value_changed_after_construction_is_refused_when_a_model_is_built():
    """`config.update(...)`, an attribute written and `from_pretrained(path, hidden_size=0)` change a config after
    its checks ran; a model built from it failed with a ZeroDivisionError in an initialiser."""
    config = tiny_config()
    config.update({"hidden_size": 0})
    with pytest.raises(ValueError, match="hidden_size must be a positive integer, got 0"):
        GPNForCausalLM(config)
    config = tiny_config()
    config.initializer_range = "0.02"
    with pytest.raises(ValueError, match="initializer_range must be a finite number, got '0.02'"):
        GPNForCausalLM(config)


def test_a_value_changed_after_construction_is_refused_at_save(tmp_path):
    """transformers' save-time validation calls its own validators, not GPNConfig's: an invalid value set after
    construction was written to config.json (a folder that then fails to load)."""
    config = tiny_config()
    config.update({"memory_key_dim": -8})
    with pytest.raises(ValueError, match="memory_key_dim must be a positive integer, got -8"):
        config.save_pretrained(tmp_path / "config")
    assert not (tmp_path / "config" / "config.json").exists()
    model = perturbed_model(tiny_config())
    model.config.eos_token_id = 500
    with pytest.raises(ValueError, match="eos_token_id must be None or a token id below vocab_size \\(97\\)"):
        model.save_pretrained(tmp_path / "model")
    assert not (tmp_path / "model" / "config.json").exists()


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2", "flex_attention"])
def test_an_attention_implementation_is_refused_by_name(tmp_path, implementation):
    """Scripts and TRL's `model_init_kwargs` set `attn_implementation` for attention models; a GPN has none, so any
    choice but the unset one (or "eager", what transformers records for it) is refused as not applying, not with
    transformers' "not supported yet, request support" for a model still to add it."""
    perturbed_model(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"attn_implementation='{implementation}' does not apply to a GPN"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation)
    for accepted in (None, "eager"):
        assert AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=accepted).config.model_type == "gpn"


def test_memoryless_config_ignores_memory_sizes():
    config = GPNConfig(use_memory=False, num_memory_heads=0)
    assert config.memory_cells == 0
    assert config.state_floats_per_row == 2 * config.hidden_size
    # memory sizes left at their defaults (not zero) count for nothing without memory
    assert GPNConfig(use_memory=False).memory_cells == 0


def test_presets_load_and_have_the_paper_sizes():
    assert {"tiny", "gpn-m-1l-130m", "gpn-m-2l-130m", "gpn-130m"} <= set(list_presets())
    # the paper's 1-layer GPN+M computes to ~129.1M parameters
    one_layer = load_preset("gpn-m-1l-130m")
    assert abs(count_parameters(one_layer) - 129.1e6) / 129.1e6 < 0.005
    assert one_layer.memory_cells == 491_520
    two_layer, no_memory = load_preset("gpn-m-2l-130m"), load_preset("gpn-130m")
    assert two_layer.num_predict_layers == 2 and two_layer.memory_cells == 360_448
    assert two_layer.bptt_truncation_length == 512
    assert not no_memory.use_memory and no_memory.hidden_size == 3184
    for config in (two_layer, no_memory):
        assert abs(count_parameters(config) - 130e6) / 130e6 < 0.005
    # a reference checkpoint of each one's shapes (claims only, nothing allocated) converts to the preset's config
    from modeling_gpn.conversion.reference import infer_config, parameter_map

    for name in ("gpn-m-1l-130m", "gpn-m-2l-130m", "gpn-130m"):
        preset = load_preset(name)
        with torch.device("meta"):
            state = GPNForCausalLM(preset).state_dict()
        claims = {
            ref: types.SimpleNamespace(shape=tuple(state[ours].shape)[:: -1 if transpose else 1])
            for ref, (ours, transpose) in parameter_map(preset).items()
        }
        inferred = infer_config(claims)
        sizes = ("vocab_size", "hidden_size", "embedding_size", "intermediate_size", "num_predict_layers", "use_memory")
        sizes += ("num_memory_heads", "memory_key_dim", "memory_value_dim") if preset.use_memory else ()
        assert {k: getattr(inferred, k) for k in sizes} == {k: getattr(preset, k) for k in sizes}, name
        assert count_parameters(inferred) == count_parameters(preset)
    # plain transformers loaders read the same files
    assert GPNConfig.from_json_file(str(preset_path("tiny"))).hidden_size == load_preset("tiny").hidden_size
    assert GPNConfig.from_pretrained(str(preset_path("gpn-m-1l-130m"))).hidden_size == 2496


# ---- conversion -----------------------------------------------------------------------------------


def fixture_params(name: str = "sot_m_1l") -> dict[str, np.ndarray]:
    folder = require_shared(f"fixtures/reference/{name}")
    with np.load(folder / "params.npz") as data:
        return {key: data[key] for key in data.files}


# optax's states for clip_by_global_norm + adamw with a weight-decay mask, named where optax (0.2) defines them
# (pickle writes an instance as its class's module and name)
ScaleByAdamState = collections.namedtuple("ScaleByAdamState", "count mu nu", module="optax._src.transform")
ScaleByScheduleState = collections.namedtuple("ScaleByScheduleState", "count", module="optax._src.transform")
EmptyState = collections.namedtuple("EmptyState", "", module="optax._src.base")
MaskedState = collections.namedtuple("MaskedState", "inner_state", module="optax.transforms._masking")
OPTAX_STATES = (ScaleByAdamState, ScaleByScheduleState, EmptyState, MaskedState)


def write_checkpoint(path, params, **extra) -> None:
    """The reference trainer's checkpoint.pkl: its opt_state is optax's state for clip_by_global_norm + adamw with a
    weight-decay mask, pickled as it is (optax's NamedTuples), written here without optax installed."""
    moments = {k: np.zeros_like(v) for k, v in params.items()}
    opt_state = (
        EmptyState(),
        (
            ScaleByAdamState(np.int32(1000), moments, dict(moments)),
            MaskedState(EmptyState()),
            ScaleByScheduleState(1000),
        ),
    )
    # `extra` first, where a hostile file puts its payload: run by a plain unpickler before anything else could fail
    # (the optax classes, which a plain unpickler without optax cannot find)
    checkpoint = {**extra, "params": params, "step": 1000, "data_position": 123456, "opt_state": opt_state}
    packages = {".".join(kind.__module__.split(".")[:n]) for kind in OPTAX_STATES for n in (1, 2, 3)}
    optax = {name: types.ModuleType(name) for name in packages}  # (pickle imports each class's module to find it)
    for kind in OPTAX_STATES:
        setattr(optax[kind.__module__], kind.__name__, kind)
    with mock.patch.dict(sys.modules, optax), open(path, "wb") as handle:
        pickle.dump(checkpoint, handle)


def test_convert_from_a_trainer_pickle_equals_the_npz_folder(tmp_path):
    """The trainer pickles its optax state beside the parameters: every such checkpoint was refused, as holding
    optax._src.base.EmptyState (the unpickler stands a plain tuple in for any optax class)."""
    folder = require_shared("fixtures/reference/sot_m_1l")
    write_checkpoint(tmp_path / "checkpoint.pkl", fixture_params())
    from_pickle = load_reference_model(tmp_path / "checkpoint.pkl")
    from_folder = load_reference_model(folder)
    tokens = torch.from_numpy(np.load(folder / "tokens.npy")).long()
    with torch.no_grad():
        assert torch.equal(from_pickle(tokens).logits, from_folder(tokens).logits)


def gpn_convert(source, out) -> subprocess.CompletedProcess:
    """`gpn convert SOURCE OUT` through the console script, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "gpn_cli", "convert", str(source), str(out)], capture_output=True, text=True
    )


def converted_from(dtype, folder: Path) -> tuple[dict, Path, subprocess.CompletedProcess]:
    """The fixture's parameters cast to `dtype`, written as a reference checkpoint in `folder` and converted by
    `gpn convert`: (the parameters, the output folder, the finished command)."""
    params = {name: array.astype(dtype) for name, array in fixture_params().items()}
    write_checkpoint(folder / "checkpoint.pkl", params)
    return params, folder / "converted", gpn_convert(folder / "checkpoint.pkl", folder / "converted")


@pytest.fixture(scope="module", autouse=True)
def conversions(request, tmp_path_factory) -> Iterator[dict]:
    """The `gpn convert` processes of the tests below, started in the background at the module's first test,
    beside the module's in-process tests (subprocesses.started_in_the_background; only the selected tests'): the
    suite's time on 2 cores. Test name -> future of what the test asserts on."""
    root = tmp_path_factory.mktemp("gpn-convert")
    for name in ("float16", "float64"):
        (root / name).mkdir()
    dtypes = "test_gpn_convert_says_so_when_it_converts_the_checkpoints_dtype_to_float32[{}]"
    jobs = {
        "test_gpn_convert_command_writes_a_loadable_folder": lambda: (
            root / "converted",
            gpn_convert(require_shared("fixtures/reference/sot_m_2l"), root / "converted"),
        ),
        dtypes.format("float16"): lambda: converted_from(np.float16, root / "float16"),
        dtypes.format("float64"): lambda: converted_from(np.float64, root / "float64"),
    }
    selected = {item.name for item in request.session.items if item.module is request.module}
    with started_in_the_background(jobs, selected) as started:
        yield started


def test_gpn_convert_command_writes_a_loadable_folder(request, conversions):
    folder = require_shared("fixtures/reference/sot_m_2l")
    out, result = conversions[request.node.name].result()
    assert result.returncode == 0, result.stderr
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpn" and config["num_predict_layers"] == 2
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_gpn.GPNForCausalLM"
    # loadable: the folder loads through transformers and computes what the reference checkpoint computes
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(loaded, GPNForCausalLM)
    tokens = torch.from_numpy(np.load(folder / "tokens.npy")).long()
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, load_reference_model(folder)(tokens).logits, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [np.float16, np.float64], ids=["float16", "float64"])
def test_gpn_convert_says_so_when_it_converts_the_checkpoints_dtype_to_float32(request, conversions, dtype):
    """A float16 or float64 checkpoint became a float32 folder in silence: converted (a GPN computes in float32)
    with one line saying so; float16 values kept exactly."""
    params, out, result = conversions[request.node.name].result()
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("gpn convert: note:")]
    assert notes == [
        f"gpn convert: note: the checkpoint's parameters are {np.dtype(dtype).name}: converted to float32 (float16 "
        "values exactly, wider ones rounded to the nearest float32)"
    ], result.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float32
    embedding = model.get_input_embeddings().weight
    assert torch.equal(embedding, torch.from_numpy(params["embedding"].astype(np.float32)))


class Payload:
    """Stands for anything a reference checkpoint never holds: unpickling it would create `mark`."""

    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (exec, (f"open({str(self.mark)!r}, 'w').close()",))


def test_foreign_object_in_pickle_is_refused(tmp_path):
    path, mark = tmp_path / "checkpoint.pkl", tmp_path / "payload-ran"
    write_checkpoint(path, fixture_params(), extra=Payload(mark))
    with pytest.raises(CheckpointError, match=r"builtins\.exec"):
        load_reference_model(path)
    assert not mark.exists(), "the payload ran before the refusal"


def test_corrupt_pickle_is_a_clear_error(tmp_path):
    path = tmp_path / "checkpoint.pkl"
    write_checkpoint(path, fixture_params())
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="not a readable reference checkpoint"):
        load_reference_model(path)


def test_missing_unexpected_and_misshaped_parameters_are_listed_together(tmp_path):
    params = fixture_params()
    del params["L0_ffn_w2_k"], params["write_W_v_k"]
    params["L0_read_W_o_k"] = params["L0_read_W_o_k"][:, :-1]
    params["mystery"] = np.zeros(3, dtype=np.float32)
    write_checkpoint(tmp_path / "checkpoint.pkl", params)
    with pytest.raises(CheckpointError) as error:
        load_reference_model(tmp_path / "checkpoint.pkl")
    message = str(error.value)
    for name in ("L0_ffn_w2_k", "write_W_v_k", "mystery", "L0_read_W_o_k"):
        assert name in message


def test_config_disagreeing_with_shapes_is_refused(tmp_path):
    folder = require_shared("fixtures/reference/sot_m_1l")
    np.savez(tmp_path / "params.npz", **fixture_params())
    config = json.loads((folder / "config.json").read_text())
    config["d_state"] = 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="d_state=64"):
        load_reference_model(tmp_path)
    # a field SoTMConfig lacks (an option of a variant the converter does not implement) was dropped in silence
    config["d_state"] = 48
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_memory_gate": True}))
    with pytest.raises(
        CheckpointError, match="fields the reference's SoTMConfig / SoTConfig does not: use_memory_gate"
    ):
        load_reference_model(tmp_path)
    # and beside a checkpoint.pkl, where a config.json went unread
    write_checkpoint(tmp_path / "checkpoint.pkl", fixture_params())
    with pytest.raises(CheckpointError, match="does not: use_memory_gate"):
        load_reference_model(tmp_path / "checkpoint.pkl")


def test_a_misshaped_or_stray_parameter_beside_a_config_json_is_named(tmp_path):
    """A cut L0_ffn_w1_k was refused as "d_ffn=64 but the parameters say intermediate_size=63", a stray L1_ffn_w2_k as
    "n_layers=1 but ... num_predict_layers=2": a size inferred from the tensor, never the tensor's name."""
    folder = require_shared("fixtures/reference/sot_m_1l")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    params = fixture_params()
    cut = dict(params, L0_ffn_w1_k=params["L0_ffn_w1_k"][:, :-2])
    stray = dict(params, L1_ffn_w2_k=params["L0_ffn_w2_k"].copy())
    for changed, named in (
        (cut, r"L0_ffn_w1_k: shape \(48, 126\), expected \(48, 128\)"),
        (stray, r"unexpected parameters: L1_ffn_w2_k\)"),
    ):
        np.savez(tmp_path / "params.npz", **changed)
        with pytest.raises(CheckpointError, match=named):
            load_reference_model(tmp_path)


def test_a_transformers_folder_or_its_weights_given_to_convert_says_what_it_is(tmp_path):
    """A GPN folder (or its model.safetensors) given as SRC was "has neither params.npz nor checkpoint.pkl" (or a
    pickle reader's "KeyError: 8"), not that it needs no conversion."""
    folder = tmp_path / "gpn"
    GPNForCausalLM(tiny_config()).save_pretrained(folder)
    with pytest.raises(CheckpointError, match="it is a transformers folder .* loads as it is with from_pretrained"):
        load_reference_model(folder)
    with pytest.raises(CheckpointError, match="is a safetensors file, not a reference checkpoint"):
        load_reference_model(folder / "model.safetensors")


def test_a_memory_config_with_memoryless_parameters_is_refused(tmp_path):
    """The GPN's parameters (sot_1l) beside a GPN+M config.json (n_heads, d_key, d_val) were converted, in silence,
    to a model without memory: the memory sizes had nothing in the memory-less parameters to be compared with."""
    folder = require_shared("fixtures/reference/sot_m_1l")
    np.savez(tmp_path / "params.npz", **fixture_params("sot_1l"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(
        CheckpointError, match=r"n_heads=3, d_key=8, d_val=16 \(a model with memory\) but the parameters"
    ):
        load_reference_model(tmp_path)


def test_the_training_window_is_lm_evals_context_length_and_no_positional_limit():
    """lm-eval reads a context length from the config (`n_positions` first): a GPN's is its training window,
    `max_length_hint`; `max_position_embeddings`, which generate() takes for a hard limit, is not there, and given
    as an argument (this hint's older name) it sets the hint."""
    from lm_eval.models.utils import resolve_max_length

    config = tiny_config(max_length_hint=96)
    assert resolve_max_length(config) == config.n_positions == 96
    assert not hasattr(config, "max_position_embeddings")
    renamed = tiny_config(max_position_embeddings=40)
    assert renamed.max_length_hint == 40 and not hasattr(renamed, "max_position_embeddings")
    assert resolve_max_length(GPNConfig.from_dict(renamed.to_dict())) == 40


def test_gpn_convert_refuses_a_folder_with_files_in_it(tmp_path, capsys):
    """OUT was overwritten in silence, leaving its files (another model's tokenizer) beside the new model."""
    from gpn_cli import main

    folder = require_shared("fixtures/reference/sot_m_1l")
    out = tmp_path / "converted"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    assert main(["convert", str(folder), str(out)]) == 1
    assert capsys.readouterr().err.startswith(f"gpn convert: Cannot write the converted model to {out}: the folder is")
    assert [path.name for path in out.iterdir()] == ["tokenizer.json"]
    (out / "tokenizer.json").unlink()  # an empty folder is as good as a new one
    assert main(["convert", str(folder), str(out)]) == 0 and (out / "model.safetensors").exists()
    capsys.readouterr()
    # A disk that fills up part-way (400 KiB: some code files fit, the weights do not) left the files written so
    # far, no model, and a folder the next try refused as not empty: a new OUT is removed, an empty one emptied.
    with small_disk(tmp_path / "disk", "400k") as disk:
        (disk / "empty").mkdir()
        for target in (disk / "new", disk / "empty"):
            assert main(["convert", str(folder), str(target)]) == 1
            assert capsys.readouterr().err.endswith("No space left on device\n")
        assert not (disk / "new").exists() and list((disk / "empty").iterdir()) == []


def test_a_second_gpn_convert_into_the_folder_another_is_writing_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    """Two conversions into one new OUT at once both found it empty and wrote into it: each file the last writer's,
    a model mixed of two checkpoints in silence. OUT is held from that check to the end of the write: a second
    conversion started meanwhile (here while the first reads its checkpoint) is refused, naming the first's pid,
    and OUT holds the first's model, whole."""
    import os

    from gpn_cli import main
    from modeling_gpn.conversion import reference

    folder, out = require_shared("fixtures/reference/sot_m_1l"), tmp_path / "converted"
    real_load, seen = reference.load_reference_model, {}

    def load_beside_another_conversion(src):
        seen["other"] = main(["convert", str(require_shared("fixtures/reference/sot_m_2l")), str(out)])
        seen["said"] = capsys.readouterr().err
        return real_load(src)

    monkeypatch.setattr(reference, "load_reference_model", load_beside_another_conversion)
    assert main(["convert", str(folder), str(out)]) == 0
    assert seen["other"] == 1 and seen["said"].startswith(
        f"gpn convert: Cannot write the converted model to {out}: {out} is in use by another process "
        f"(pid {os.getpid()}: "
    ), seen["said"]
    assert json.loads((out / "conversion.json").read_text())["source"] == "sot_m_1l"  # the first's, whole


def test_gpn_convert_refuses_a_tokenizer_with_more_ids_than_the_model(tmp_path, capsys):
    """The LLaMA-2 tokenizer (32,000 ids) was saved beside a model of 97 tokens."""
    from gpn_cli import main

    folder = require_shared("fixtures/reference/sot_m_1l")
    tokenizer = require_shared("data/llama2-tokenizer")
    out = tmp_path / "converted"
    assert main(["convert", str(folder), str(out), "--tokenizer", str(tokenizer)]) == 1
    assert "has 32,000 token ids, more than the model's vocab_size of 97" in capsys.readouterr().err
    assert not out.exists()
    assert main(["convert", str(folder), str(out), "--tokenizer", "nobody/no-such-tokenizer"]) == 1  # offline
    err = capsys.readouterr().err  # one line, though transformers' own message runs over two
    assert err.startswith("gpn convert: Cannot load tokenizer 'nobody/no-such-tokenizer': ") and err.count("\n") == 1
    assert not out.exists()
