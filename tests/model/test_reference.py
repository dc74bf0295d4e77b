"""The converted model reproduces the reference JAX implementation (fixtures/reference).

Index shift (GPN.md): hf_logits[:, :-1] == ref_logits[:, 1:]; the reference's position 0 is the
prediction from the empty state. The reference defers the last memory write to its next call, so its
final carry (s, prev_s, M) is one write behind our cache (p, g, M).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modeling_gpn.conversion import load_reference_model
from modeling_gpn.conversion.reference import parameter_map

from ..environment import require_shared

FIXTURES = ["sot_1l", "sot_m_1l", "sot_m_1l_bias", "sot_m_2l"]


def load_fixture(name: str):
    folder = require_shared(f"fixtures/reference/{name}")
    model = load_reference_model(folder)
    tokens = torch.from_numpy(np.load(folder / "tokens.npy")).long()
    outputs = dict(np.load(folder / "outputs.npz"))
    return folder, model, tokens, outputs


def reference_loss(model, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The reference's loss: mean CE over all B*T positions, position 0 predicted from the empty state."""
    batch, length = tokens.shape
    first = F.cross_entropy(model.empty_state_logits(batch).float(), tokens[:, 0], reduction="sum")
    rest = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1), reduction="sum"
    )
    return (first + rest) / (batch * length)


@pytest.mark.parametrize("name", FIXTURES)
def test_logits_states_and_loss_match_reference(name):
    _, model, tokens, ref = load_fixture(name)
    with torch.no_grad():
        out = model(tokens, labels=tokens, use_cache=True, output_predicted_states=True)

    # logits, shifted by one position
    np.testing.assert_allclose(out.logits[:, :-1].numpy(), ref["logits"][:, 1:], atol=1e-4, rtol=0)
    # the reference's position 0 is the prediction from the zero state
    np.testing.assert_allclose(model.empty_state_logits(2).detach().numpy(), ref["logits"][:, 0], atol=1e-4, rtol=0)
    # predicted states (the paper's object of study)
    np.testing.assert_allclose(out.predicted_states[:, :-1].numpy(), ref["trace_predicted"][:, 1:], atol=1e-4, rtol=0)

    # loss relation: ref_loss * T = CE(ref_logits[:, 0], x_0) + hf_loss * (T - 1), per row mean
    length = tokens.shape[1]
    ce0 = F.cross_entropy(torch.from_numpy(ref["logits"][:, 0]), tokens[:, 0])
    assert abs(float(ref["loss"]) * length - (float(ce0) + float(out.loss) * (length - 1))) < 1e-5 * length
    assert abs(float(reference_loss(model, tokens, out.logits).detach()) - float(ref["loss"])) < 1e-5

    # final cache: its grounded state is the reference's s
    predicted, grounded, memory = out.cache.get_state()
    np.testing.assert_allclose(grounded.numpy(), ref["s"], atol=1e-4, rtol=0)
    if "M" in ref:
        # our memory has had the write the reference defers: apply it to the reference's carry
        write = model.model.memory_write
        with torch.no_grad():
            ref_memory_after, _ = write(
                torch.from_numpy(ref["M"]), torch.from_numpy(ref["prev_s"]), torch.from_numpy(ref["s"])
            )
        np.testing.assert_allclose(memory.numpy(), ref_memory_after.numpy(), atol=1e-4, rtol=0)
        # and the write before that is the reference's stored memory after step T-1
        np.testing.assert_allclose(ref["trace_M"][:, -1], ref["M"], atol=1e-6)


def test_continuation_from_cache_matches_reference():
    folder, model, tokens, ref = load_fixture("sot_m_1l")
    tokens_cont = torch.from_numpy(np.load(folder / "tokens_cont.npy")).long()
    ref_cont = np.load(folder / "outputs_cont.npz")
    with torch.no_grad():
        first = model(tokens, use_cache=True)
        second = model(tokens_cont, cache=first.cache, use_cache=True)
    # the last prediction of window 1 is the reference's first prediction of window 2
    np.testing.assert_allclose(first.logits[:, -1].numpy(), ref_cont["logits"][:, 0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(second.logits[:, :-1].numpy(), ref_cont["logits"][:, 1:], atol=1e-4, rtol=0)
    _, grounded, _ = second.cache.get_state()
    np.testing.assert_allclose(grounded.numpy(), ref_cont["s"], atol=1e-4, rtol=0)
    assert second.cache.get_seq_length() == tokens.shape[1] + tokens_cont.shape[1]


def test_gradients_match_reference():
    folder, model, tokens, ref = load_fixture("sot_m_1l")
    grads = np.load(folder / "grads.npz")
    model.zero_grad()
    out = model(tokens, use_cache=False)
    reference_loss(model, tokens, out.logits).backward()
    ours = dict(model.named_parameters())
    for ref_name, (name, transpose) in parameter_map(model.config).items():
        grad = ours[name].grad
        assert grad is not None, f"no gradient for {name}"
        grad = grad.T if transpose else grad
        expected = grads[ref_name]
        scale = np.abs(expected).max()
        assert scale > 0
        error = np.abs(grad.numpy() - expected).max() / scale
        assert error < 1e-4, f"{ref_name}: relative gradient error {error:.2e}"
