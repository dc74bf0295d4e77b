"""A method of the equations replaced on a module's instance, by a subclass or on its class is never skipped.

The fast path computes the step from the modules' weights and never calls `ground`, `step`, `ffn`, `read`,
`keys`, ... nor the segment layer's forward, so a replacement of one of them (an interpretability user's steering
patch, a subclass that overrides a step) takes effect only where the method is called: the plain path then runs
(`modeling_gpn.RECURRENCE_METHODS`, `derived_weights.replaced_method`), for inference and training alike.
Before, the fast path ran and computed the model as written, in silence. (A decoded token in one C call, which
also skips the base model's forward, its decoder and `logits_of`: tests/fast_path/test_decode_call.py.)
"""

from __future__ import annotations

import pytest
import torch

from modeling_gpn.modeling_gpn import GPNModel, GPNPredictLayer, GPNRMSNorm

from ..backend_observer import FAST_PATH, PLAIN_PATH, ran
from ..tiny_models import perturbed_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")


def scaled(method):
    return lambda *args, **kwargs: 1.5 * method(*args, **kwargs)


class SteeredModel(GPNModel):
    """A subclass whose step steers the predicted state."""

    def step(self, predicted, older_grounded, memory, token_input):
        predicted, grounded, memory, gamma = super().step(predicted, older_grounded, memory, token_input)
        return predicted + 0.5, grounded, memory, gamma


def steered_segment_outputs(segment):
    """The segment layer's outputs (the predicted states it returns) shifted, as a steering patch would."""
    forward = segment.forward
    segment.forward = lambda *args, **kwargs: (lambda out: (out[0] + 0.5, *out[1:]))(forward(*args, **kwargs))


REPLACEMENTS = {
    "ground on the model's instance": lambda m, patch: setattr(m.model, "ground", scaled(m.model.ground)),
    "ffn on a layer's instance": lambda m, patch: setattr(
        m.model.predict_layers[1], "ffn", scaled(m.model.predict_layers[1].ffn)
    ),
    "keys on the memory write's instance": lambda m, patch: setattr(
        m.model.memory_write, "keys", scaled(m.model.memory_write.keys)
    ),
    "read assigned to the class": lambda m, patch: patch.setattr(GPNPredictLayer, "read", scaled(GPNPredictLayer.read)),
    "forward assigned to the norms' class": lambda m, patch: patch.setattr(
        GPNRMSNorm, "forward", scaled(GPNRMSNorm.forward)
    ),
    "step overridden by a subclass": lambda m, patch: setattr(m.model, "__class__", SteeredModel),
    "segment layer's forward on its instance": lambda m, patch: steered_segment_outputs(m.model.segment_layer),
}


def logits_and_gradients(model, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """No-grad logits (a few rows: the C step kernels where the fast path runs), then a training step's loss and
    the gradients of every parameter."""
    with torch.no_grad():
        logits = model.eval()(ids).logits
    model.train().zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    return logits, loss.detach(), *(p.grad for p in model.parameters())


@pytest.mark.parametrize("replacement", REPLACEMENTS)
def test_a_replaced_method_runs_the_plain_path_which_calls_it(replacement, monkeypatch):
    """With the method replaced the plain path runs (the blocker names the method), inference and training, and
    computes with the replacement: its logits and gradients differ from the model's as written."""
    model = perturbed_model(tiny_config(num_predict_layers=2), seed=31)
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(32))
    with ran(FAST_PATH, not_ran=(PLAIN_PATH,)):
        as_written = logits_and_gradients(model, ids)
    REPLACEMENTS[replacement](model, monkeypatch)
    name = replacement.split()[0]
    assert name in model.model.fast_path_blocker()
    with ran(PLAIN_PATH, not_ran=(FAST_PATH,)):
        replaced = logits_and_gradients(model, ids)
    model.model.use_fast_path = False
    plain = logits_and_gradients(model, ids)
    for got, expected in zip(replaced, plain):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(replaced[0], as_written[0], atol=1e-3)
    assert not torch.allclose(replaced[2], as_written[2], atol=1e-4)  # (the embedding's gradient)


def test_a_subclass_that_overrides_nothing_keeps_the_fast_path():
    """Only a method that differs from the one written here makes the plain path run: a subclass of the model
    that adds a helper but overrides no step method keeps the fast path."""

    class Annotated(GPNModel):
        def describe(self) -> str:
            return "a GPN"

    model = perturbed_model(tiny_config(), seed=33)
    model.model.__class__ = Annotated
    assert model.model.fast_path_blocker() is None
    with ran(FAST_PATH, not_ran=(PLAIN_PATH,)), torch.no_grad():
        model(torch.randint(1, 97, (2, 5)))
