"""The everyday transformers surface on a saved GPN folder, beyond generate() and training: what a user does with
any causal LM, compared with the model's own forward and generate().

transformers' pipelines (text-classification on a `GPNForSequenceClassification` folder), its streamers, a
`generation_config.json` saved with the model, and loading a sharded bfloat16 checkpoint. The text-generation
pipeline is tested beside generate() (tests/model/test_generate.py).
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from ..tiny_models import perturbed_model, tiny_config


@pytest.fixture(scope="module")
def bpe_tokenizer():
    from modeling_gpn.data import train_bpe_tokenizer

    return train_bpe_tokenizer(["the cat sat on the mat. " * 20, "to be or not to be " * 20], 300)


def test_the_text_classification_pipeline_scores_each_text_as_the_model_does(tmp_path, bpe_tokenizer):
    """`pipeline("text-classification")` on a saved `GPNForSequenceClassification` folder: texts of different lengths
    in one right-padded batch get the label probabilities of the score head at each text's last token, read alone."""
    from transformers import AutoModelForSequenceClassification, pipeline

    from modeling_gpn import GPNForSequenceClassification

    labels = {0: "neg", 1: "neu", 2: "pos"}
    config = tiny_config(
        vocab_size=len(bpe_tokenizer),
        eos_token_id=None,
        pad_token_id=bpe_tokenizer.pad_token_id,
        num_labels=3,
        id2label=labels,
        label2id={name: i for i, name in labels.items()},
    )
    model = GPNForSequenceClassification(config)
    model.load_state_dict(
        perturbed_model(tiny_config(vocab_size=len(bpe_tokenizer)), seed=5).state_dict(), strict=False
    )
    with torch.no_grad():
        model.score.weight.normal_(generator=torch.Generator().manual_seed(6))
    model.save_pretrained(tmp_path)
    bpe_tokenizer.save_pretrained(tmp_path)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    texts = ["the cat sat on the mat, to be or not", "to be"]
    with torch.no_grad():  # each text alone, scored at its last token
        alone = [
            model.score(model.model(**bpe_tokenizer(text, return_tensors="pt")).last_hidden_state[0, -1]).softmax(-1)
            for text in texts
        ]
    classifier = pipeline("text-classification", model=str(tmp_path), device="cpu")
    assert classifier.tokenizer.padding_side == "right"  # the padded row's last real token is not its last position
    scored = classifier(texts, top_k=None, batch_size=2)
    for expected, answer in zip(alone, scored, strict=True):
        got = torch.tensor([next(d["score"] for d in answer if d["label"] == labels[i]) for i in range(3)])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert [answer["label"] for answer in classifier(texts)] == [labels[int(p.argmax())] for p in alone]


def test_streamers_and_a_saved_generation_config_give_generates_tokens(tmp_path, bpe_tokenizer):
    """A `generation_config.json` saved with the model is what a reloaded model's generate() and the text-generation
    pipeline decode with; `TextIteratorStreamer` in a thread streams generate()'s text."""
    from transformers import AutoModelForCausalLM, GenerationConfig, TextIteratorStreamer, pipeline

    tokenizer = bpe_tokenizer
    model = perturbed_model(tiny_config(vocab_size=len(tokenizer), eos_token_id=None), seed=13)
    model.generation_config = GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["repetition_penalty"] == 1.3
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    prompt = tokenizer("the cat", return_tensors="pt").input_ids
    explicit = model.generate(prompt, max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    assert not torch.equal(explicit, model.generate(prompt, max_new_tokens=6, do_sample=False, repetition_penalty=1.0))
    assert torch.equal(reloaded.generate(prompt), explicit)
    new_text = tokenizer.decode(explicit[0, prompt.shape[1] :])
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    assert generator("the cat", return_full_text=False)[0]["generated_text"] == new_text

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    thread = threading.Thread(target=reloaded.generate, kwargs=dict(input_ids=prompt, streamer=streamer))
    thread.start()
    streamed = "".join(streamer)
    thread.join()
    assert streamed == new_text


def test_a_sharded_bfloat16_checkpoint_reloads_tied_with_the_same_logits(tmp_path):
    """`model.to(torch.bfloat16)` saved in shards (`max_shard_size`) reloads as bfloat16 (the saved dtype), with the
    output matrix tied to the embedding (the one table saved) and the same logits."""
    from transformers import AutoModelForCausalLM

    model = perturbed_model(tiny_config(), seed=21).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(path.name for path in tmp_path.glob("model-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and "lm_head.weight" not in index["weight_map"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.dtype == torch.bfloat16
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
