"""save_pretrained round trips (registered classes and remote code) and clear errors on bad input."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from modeling_gpn import GPNCache, GPNForCausalLM

from ..tiny_models import perturbed_model, tiny_config

# A finder that makes `modeling_gpn` unimportable, so the remote-code load cannot lean on the
# installed package (an editable install puts its own finder on sys.meta_path).
BLOCK_PACKAGE = textwrap.dedent(
    """
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "modeling_gpn" or name.startswith("modeling_gpn."):
                raise ImportError("modeling_gpn is deliberately not importable here")
    sys.meta_path.insert(0, _Block())
    """
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpn")
    model = perturbed_model(tiny_config(num_predict_layers=2, use_decoder_bias=True), seed=5)
    model.save_pretrained(folder)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    return folder, model, ids, logits


def test_save_writes_safetensors_modeling_files_and_auto_map(saved):
    folder, *_ = saved
    names = {path.name for path in folder.iterdir()}
    assert {"model.safetensors", "config.json", "modeling_gpn.py", "configuration_gpn.py"} <= names
    assert not any(name.endswith((".bin", ".pt", ".pkl")) for name in names)
    config = AutoConfig.from_pretrained(folder)
    assert config.auto_map["AutoModelForCausalLM"] == "modeling_gpn.GPNForCausalLM"
    # (transformers itself records only the saved class's own auto class: the others are gpn's save_pretrained's)
    assert config.auto_map["AutoModel"] == "modeling_gpn.GPNModel"
    assert config.auto_map["AutoModelForSequenceClassification"] == "modeling_gpn.GPNForSequenceClassification"


def test_from_pretrained_with_registered_classes(saved):
    folder, _, ids, logits = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(loaded, GPNForCausalLM)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_trust_remote_code_in_a_fresh_process_without_the_package(saved, tmp_path):
    folder, _, ids, logits = saved
    torch.save({"ids": ids}, tmp_path / "ids.pt")
    script = BLOCK_PACKAGE + textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        assert "modeling_gpn" not in sys.modules
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        ids = torch.load({str(tmp_path / "ids.pt")!r})["ids"]
        with torch.no_grad():
            torch.save(model(ids).logits, {str(tmp_path / "logits.pt")!r})
            # a kept state saved and loaded through the remote code's own cache, whose GPNConfig class is not the
            # config's (transformers loads configuration_gpn.py once for AutoConfig and again beside the model)
            cache = model(ids[:, :7], use_cache=True).cache
            cache.save({str(tmp_path / "state.safetensors")!r})
            loaded = type(cache).load({str(tmp_path / "state.safetensors")!r}, model)
            continued = model(ids[:, 7:], cache=loaded).logits
            torch.save(continued, {str(tmp_path / "continued.pt")!r})
        """
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    env["OMP_NUM_THREADS"] = "1"  # (this process's one thread, tests/conftest.py: its logits compared to the bit)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert torch.equal(torch.load(tmp_path / "logits.pt"), logits)
    torch.testing.assert_close(torch.load(tmp_path / "continued.pt"), logits[:, 7:], rtol=1e-5, atol=1e-5)


# ---- bad input ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return perturbed_model(tiny_config(), seed=6)


@pytest.mark.parametrize("bad_id", [97, 1000, -1])
def test_token_id_outside_vocabulary_names_id_and_vocab_size(model, bad_id):
    ids = torch.tensor([[1, 2, bad_id, 4]])
    with pytest.raises(ValueError, match=rf"Token id {bad_id} at \(row 0, position 2\).*vocab_size=97"):
        model(ids)


def test_mask_of_the_wrong_shape(model):
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="only 0"):
        model(ids, attention_mask=torch.full((2, 5), 2))


@pytest.mark.parametrize("shape", [(1, 0), (0, 5)])
def test_empty_input(model, shape):
    """An empty prompt is refused, pointing to the prediction made before any token (what it may have meant)."""
    with pytest.raises(ValueError, match="at least one row and one token.*empty_state_logits"):
        model(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one row and one token.*empty_state_logits"):
        model(inputs_embeds=torch.zeros(*shape, model.config.embedding_size))


@pytest.mark.parametrize("batch_size", [-1, 2.5, True])
def test_an_empty_state_batch_size_that_is_not_a_count_is_named(model, batch_size):
    """torch's zeros failed with "zeros() takes 1 positional argument but 2 were given" (2.5, True) or a bare
    "Dimension size must be non-negative" (-1), naming neither the argument nor the method."""
    with pytest.raises(ValueError, match=rf"empty_state_logits needs a batch size .* got {batch_size!r}"):
        model.empty_state_logits(batch_size)
    assert model.empty_state_logits(0).shape == (0, 97)


def test_float_ids_and_wrong_cache(model):
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 3))
    cache = model(torch.randint(0, 97, (2, 3)), use_cache=True).cache
    with pytest.raises(ValueError, match="cache holds 2 rows"):
        model(torch.randint(0, 97, (3, 1)), cache=cache, use_cache=True)
    assert isinstance(cache, GPNCache)


@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.int8, torch.uint16])
def test_ids_of_a_dtype_the_embedding_refuses_are_named_with_the_fix(model, dtype):
    """int16 / uint8 ids were torch's embedding error ("Expected tensor for argument #1 'indices' ..."), uint16
    a NotImplementedError from the range check; each is refused naming its dtype and `.long()`."""
    with pytest.raises(ValueError, match=rf"got dtype {dtype}: pass input_ids.long\(\)"):
        model(torch.tensor([[1, 2, 3]], dtype=dtype))


def test_inputs_embeds_that_are_not_floating_point_are_refused(model):
    """Integer or boolean inputs_embeds (ids passed as embeddings) were cast and run in silence; float64 ones are
    embeddings and give the float32 ones' outputs."""
    embeds = model.get_input_embeddings()(torch.tensor([[1, 2, 3]])).detach()
    for dtype in (torch.int64, torch.bool):
        with pytest.raises(ValueError, match=rf"inputs_embeds must be floating-point embeddings, got dtype {dtype}"):
            model(inputs_embeds=embeds.to(dtype))
    with torch.no_grad():
        assert torch.equal(model(inputs_embeds=embeds.double()).logits, model(inputs_embeds=embeds).logits)


def test_input_ids_that_are_not_a_tensor_are_named(model):
    """A list or a numpy array of ids failed on a missing attribute ("'list' object has no attribute 'dim'"), on the
    one-call decode of a token from a cache as on any other call."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]]), use_cache=True).cache
        for ids, kwargs in (([[1, 2, 3]], {}), (np.array([[4]]), {"cache": cache, "use_cache": True})):
            with pytest.raises(TypeError, match=rf"input_ids must be a torch.Tensor .* got {type(ids).__name__}"):
                model(ids, **kwargs)


def test_int32_ids_are_taken_as_int64_ones(model):
    """torch's embedding takes int32 ids: the model gives the same outputs for them as for int64 ones."""
    ids = torch.tensor([[1, 2, 3, 96]])
    assert torch.equal(model(ids.int()).logits, model(ids).logits)


def test_labels_of_the_wrong_shape(model):
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match="labels must have shape"):
        model(ids, labels=ids[:, :4])


def test_logits_to_keep_that_names_no_positions_is_refused(model):
    """`logits_to_keep` is a count (>= 0) or a 1-D tensor of positions (tests/model/test_packed.py); a negative count
    kept all but the first positions, a 0-d tensor was read as a count where transformers reads an index, an index
    past the end failed inside the indexing (on a GPU, a device-side assert)."""
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0 .* got -2"):
        model(ids, logits_to_keep=-2)
    with torch.no_grad():  # a decoded token too (the one-call decode took it and returned the token's logits)
        cache = model(ids, use_cache=True).cache
        with pytest.raises(ValueError, match="logits_to_keep must be an int >= 0 .* got -1"):
            model(ids[:, :1], cache=cache, use_cache=True, logits_to_keep=-1)
    with pytest.raises(ValueError, match=r"logits_to_keep must be .* got a tensor of shape \(\)"):
        model(ids, logits_to_keep=torch.tensor(3))
    with pytest.raises(ValueError, match=r"logits_to_keep names positions \[1, 5\] but the input has 5 positions"):
        model(ids, logits_to_keep=torch.tensor([1, 5]))


def test_labels_outside_the_vocabulary_or_not_int64_are_named(model):
    """A label that is neither a token id of the model nor -100 failed inside torch's cross-entropy ("Target 200 is
    out of bounds", on a GPU a device-side assert), float or int32 labels there by dtype; -100 stays ignored."""
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    for bad in (97, -1):
        labels = ids.clone()
        labels[1, 3] = bad
        for name in ("labels", "shift_labels"):
            with pytest.raises(ValueError, match=rf"{name} holds {bad} at \(row 1, position 3\).*vocab_size=97"):
                model(ids, **{name: labels})
    with pytest.raises(ValueError, match="labels must be token ids of dtype torch.int64.*got dtype torch.float32"):
        model(ids, labels=ids.float())
    flat = ids[0].clone()  # (1-D labels: an IndexError while the bad one was named)
    flat[4] = 97
    with pytest.raises(ValueError, match=r"labels holds 97 at index \(4,\)"):
        model(ids[:1], labels=flat)
    ignored = ids.clone()
    ignored[:, 2] = -100
    assert torch.isfinite(model(ids, labels=ignored).loss)


def test_a_cache_another_model_filled_is_refused_naming_the_shapes(model):
    """A cache from a model of other sizes failed inside a matrix product, or (decoding one token, where the fast path
    runs the C kernels) with the kernels' own refusal of their arguments; it is named as another model's state."""
    ids = torch.tensor([[1, 2, 3]])
    for other, part in (
        (tiny_config(hidden_size=40), r"its p has shape \(1, 40\), this model's has \(1, 48\)"),
        (tiny_config(memory_value_dim=8), r"its memory has shape \(1, 3, 8, 8\), this model's has \(1, 3, 8, 16\)"),
        (tiny_config(use_memory=False), r"its memory has shape \(1, 0\)"),
    ):
        with torch.no_grad():
            cache = perturbed_model(other)(ids, use_cache=True).cache
            for new in (ids[:, :1], ids):  # one decoded token (the fast path's C call), and a prompt
                with pytest.raises(ValueError, match="The cache holds a state of another model: " + part):
                    model(new, cache=cache)


def test_attention_outputs_asked_for_are_refused_not_returned_as_none(model):
    """A GPN has no attention weights: `output_attentions=True` (to either forward, to generate(), or set in the
    config) is refused by name, never answered with `attentions=None`; `False`, which tools pass every model,
    computes what no argument does."""
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        plain = model(ids).logits
        assert torch.equal(model(ids, output_attentions=False).logits, plain)
        for forward in (model, model.model):
            with pytest.raises(ValueError, match="no attention layers"):
                forward(ids, output_attentions=True)
    with pytest.raises(ValueError, match="no attention layers"):
        model.generate(ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    config = tiny_config()
    config.output_attentions = True
    with pytest.raises(ValueError, match="no attention layers"), torch.no_grad():
        perturbed_model(config, seed=6)(ids)
