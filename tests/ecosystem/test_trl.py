"""TRL 1.16 trains a GPN as its documentation shows, with no overrides: `SFTTrainer` (plain, packed and padding-free,
with a LoRA `peft_config`), `DPOTrainer`, `GRPOTrainer` (without vLLM) and `RewardTrainer`, and transformers'
`Trainer` fine-tunes `GPNForSequenceClassification` on a tiny labelled set.

TRL scores tokens through its own fused LM head (`trl.trainer.utils.add_fused_lm_head`): it runs
`model.base_model(...)` and multiplies `last_hidden_state` by `model.get_output_embeddings().weight`. Every
fused-head call the trainers make here is recomputed by the GPN's own forward on the same inputs
(`FusedHeadCheck`, a forward hook on the module the trainer calls): the per-token log-probabilities equal
`log_softmax` of the model's own logits and the loss equals the model's own loss, packed or not. The datasets are
built in the tests, the tokenizer is a small byte-level BPE trained here (offline).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ..tiny_models import TINY_TEXT as TEXT
from ..tiny_models import perturbed_model, tiny_config
from ..trainer_arguments import common_arguments

pytest.importorskip("trl")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer():
    from modeling_gpn.data import train_bpe_tokenizer

    return train_bpe_tokenizer(TEXT * 4, vocab_size=300)


def gpn(tokenizer, seed: int = 16, **overrides):
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    return perturbed_model(config, seed=seed).train()


@pytest.fixture(scope="module")
def gpn_folder(tokenizer, tmp_path_factory):
    """A saved GPN with its tokenizer: DPO and GRPO are given a model name, as their documentation shows (DPO
    builds its reference model from it)."""
    folder = tmp_path_factory.mktemp("trl-gpn")
    gpn(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def own_log_probs(logits: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """log_softmax of the logits at each next-token label, zero where the label is -100 (TRL's layout)."""
    if shift_labels is None:
        logits, targets = logits[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    picked = F.log_softmax(logits.float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return picked * (targets != -100)


class FusedHeadCheck:
    """A forward hook on the module a trainer calls: each call with `fused_lm_head=True` is run again through the
    GPN's own forward (the class's, not TRL's patched one; with PEFT, the adapted base model's) on the same inputs,
    and its log-probabilities and loss are compared with TRL's."""

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[float, float]] = []  # (TRL's fused loss, the model's own loss)
        self.handle = module.register_forward_hook(self.check, with_kwargs=True)

    def check(self, module, args, kwargs, output):
        if not kwargs.get("fused_lm_head"):
            return
        model = module.get_base_model() if hasattr(module, "get_base_model") else module
        labels, shift_labels = kwargs.get("labels"), kwargs.get("shift_labels")
        inputs = {k: v for k, v in kwargs.items() if k not in ("fused_lm_head", "labels", "shift_labels")}
        with torch.no_grad():
            own = type(model).forward(model, *args, labels=labels, shift_labels=shift_labels, **inputs)
        expected = own_log_probs(own.logits, labels, shift_labels)
        torch.testing.assert_close(output.log_probs.float(), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(output.loss.float(), own.loss.float(), rtol=1e-5, atol=1e-6)
        self.calls.append((float(output.loss), float(own.loss)))

    def remove(self) -> None:
        self.handle.remove()


def logged(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


# --------------------------------------------------------------------------------------------------
# The fused head itself
# --------------------------------------------------------------------------------------------------


CASES = {
    "padded": {},
    "packed": {},
    "decoder bias": dict(use_decoder_bias=True),
    "lora all-linear": {},
    "lora on the embedding": {},
    "modules_to_save embedding": {},
    "trainable tokens": {},
    "d == e": dict(hidden_size=32, intermediate_size=48),
}  # (where p alone would have fit the head's width)
ADAPTERS = {  # the PEFT config of each adapted case; the embedding's cases make the output follow a wrapped embedding
    "lora all-linear": dict(target_modules="all-linear"),
    "lora on the embedding": dict(target_modules=["embed_tokens", "decode_proj"]),
    "modules_to_save embedding": dict(target_modules=["decode_proj"], modules_to_save=["embed_tokens"]),
    "trainable tokens": dict(target_modules=["decode_proj"], trainable_token_indices={"embed_tokens": [3, 7, 50]}),
}


def adapted(model: torch.nn.Module, case: str) -> torch.nn.Module:
    """`model` with the case's PEFT adapter, its weights drawn from a fixed seed; a `modules_to_save` copy of the
    embedding and trainable tokens are moved off the original, as training would move them."""
    import peft

    torch.manual_seed(5)
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **ADAPTERS[case])
    model = peft.get_peft_model(model, config)
    embedding = model.get_base_model().model.embed_tokens
    if hasattr(embedding, "modules_to_save"):
        with torch.no_grad():
            copy = embedding.modules_to_save["default"].weight
            copy.add_(0.5 * torch.randn(copy.shape, generator=torch.Generator().manual_seed(6)))
    if hasattr(embedding, "token_adapter"):  # (the head carries the same, tied, token adapter)
        with torch.no_grad():
            for delta in embedding.token_adapter.trainable_tokens_delta.values():
                delta.add_(0.5 * torch.randn(delta.shape, generator=torch.Generator().manual_seed(6)))
    return model


@pytest.mark.parametrize("case", CASES)
def test_trl_fused_head_log_probs_equal_log_softmax_of_the_models_logits(case):
    """`add_fused_lm_head` (what SFT, DPO, GRPO, RLOO, KTO use) on a GPN: log-probabilities, loss and gradients
    equal those of the model's own logits. With an adapter on the embedding (LoRA or a `modules_to_save` copy) the
    output follows the adapted table, and so does TRL's head, which reads `get_output_embeddings().weight`: the
    gradients reach the adapter (the unadapted table would give other log-probabilities)."""
    from trl.trainer.utils import add_fused_lm_head

    model = perturbed_model(tiny_config(**CASES[case]), seed=3).train()
    if case == "decoder bias":
        assert model.model.decode_proj.bias is not None
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 97, (2, 11), generator=generator)
    inputs = {"input_ids": ids}
    labels = ids.clone()
    labels[0, :3] = -100
    if case == "padded":
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding
        mask[1, -3:] = 0  # right padding
        inputs["attention_mask"] = mask
        labels = labels.masked_fill(mask == 0, -100)
    if case == "packed":  # two sequences in row 0, three in row 1 (position ids restart)
        positions = [[*range(5), *range(6)], [*range(4), *range(3), *range(4)]]
        inputs["position_ids"] = torch.tensor(positions)
        labels[0, 5] = labels[1, 4] = labels[1, 7] = -100
    reference = perturbed_model(tiny_config(**CASES[case]), seed=3).train()
    if case in ADAPTERS:
        model, reference = adapted(model, case), adapted(reference, case)
        base = model.get_base_model()
        assert not hasattr(base.lm_head, "lora_A") and hasattr(base.model.decode_proj, "lora_A")
        if case != "trainable tokens":  # (whose adapter PEFT ties to the head)
            assert type(base.lm_head) is torch.nn.Linear  # left out by identity
        assert base.output_follows_embedding() is (case in ("lora on the embedding", "modules_to_save embedding"))
    fused_model = model.get_base_model() if case in ADAPTERS else model
    add_fused_lm_head(fused_model, outputs=("log_probs", "entropy", "is_top1"))

    fused = model(**inputs, labels=labels, fused_lm_head=True)
    own = reference(**inputs)
    expected = own_log_probs(own.logits, labels, None)
    torch.testing.assert_close(fused.log_probs, expected, rtol=1e-5, atol=1e-5)
    probs = F.softmax(own.logits[:, :-1].float(), dim=-1)
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1) * (labels[:, 1:] != -100)
    torch.testing.assert_close(fused.entropy, entropy, rtol=1e-4, atol=1e-5)
    own_loss = reference(**inputs, labels=labels).loss
    torch.testing.assert_close(fused.loss, own_loss, rtol=1e-5, atol=1e-6)
    fused.loss.backward()
    own_loss.backward()
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    references = dict(reference.named_parameters())
    assert trained and all(p.grad is not None for _, p in trained)
    if case == "lora on the embedding":
        assert any("lora_embedding_A" in n for n, _ in trained)
    if case == "modules_to_save embedding":
        assert any("embed_tokens.modules_to_save" in n for n, _ in trained)
    if case == "trainable tokens":
        assert any("trainable_tokens_delta" in n for n, _ in trained)
    for name, param in trained:
        torch.testing.assert_close(param.grad, references[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case", ["lora on the embedding", "modules_to_save embedding", "trainable tokens"])
def test_trl_fused_head_computes_a_wrapped_embeddings_table_once_per_step(case):
    """TRL's fused head reads `get_output_embeddings().weight` three times a call (the device of the hidden states,
    of the labels, then the weight itself); while the output follows a wrapped embedding that weight is the table it
    computes, a forward over the whole vocabulary. It is computed once per step (forward and backward): it was
    three times."""
    from trl.trainer.utils import add_fused_lm_head

    model = adapted(perturbed_model(tiny_config(), seed=3).train(), case)
    base = model.get_base_model()
    embedding = base.model.embed_tokens
    tables = []
    forward = embedding.forward

    def counted(ids, *args, **kwargs):
        if ids.shape == (base.config.vocab_size,):  # the whole table, not a batch's tokens
            tables.append(ids)
        return forward(ids, *args, **kwargs)

    embedding.forward = counted
    add_fused_lm_head(base, outputs=("log_probs",))
    ids = torch.randint(1, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    model(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()
    assert len(tables) == 1
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad and "embed" in n)


# --------------------------------------------------------------------------------------------------
# SFT, DPO, GRPO
# --------------------------------------------------------------------------------------------------


SFT_ADAPTERS = {
    "plain": None,
    "lora": dict(target_modules="all-linear"),
    "lora on the embedding": dict(target_modules=["embed_tokens", "decode_proj"]),
    "modules_to_save embedding": dict(target_modules=["decode_proj"], modules_to_save=["embed_tokens"]),
    "trainable tokens": dict(target_modules=["decode_proj"], trainable_token_indices={"embed_tokens": [3, 7, 50]}),
}
ADAPTER_WEIGHTS = {  # what each variant trains besides the decoder's LoRA
    "lora": "lora_",
    "lora on the embedding": "embed_tokens.lora_embedding_",
    "modules_to_save embedding": "embed_tokens.modules_to_save.",
    "trainable tokens": "embed_tokens.token_adapter.trainable_tokens_delta",
}


def base_weight_name(name: str) -> str:
    """The plain model's name of a PEFT model's base weight."""
    name = name.removeprefix("base_model.model.")
    for wrapper in (".base_layer", ".original_module", ".token_adapter"):
        name = name.replace(wrapper, "")
    return name


@pytest.mark.parametrize("variant", SFT_ADAPTERS)
def test_sft_trainer_trains_with_the_models_own_loss(tokenizer, tmp_path, variant):
    """SFTTrainer as its documentation shows (a text dataset; with `peft_config=LoraConfig(target_modules=
    "all-linear")`): every step's loss is the model's own loss on the same batch, and it trains. An adapter on the
    embedding (LoRA, a `modules_to_save` copy or trainable tokens, for new tokens) is followed by the output, by TRL's
    fused head too: the adapter trains, the base weights do not move."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    model = gpn(tokenizer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adapter = SFT_ADAPTERS[variant]
    peft_config = LoraConfig(r=4, lora_alpha=8, **adapter) if adapter else None
    args = SFTConfig(**common_arguments(tmp_path, max_steps=3), max_length=32, per_device_train_batch_size=4)
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"text": TEXT}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    check = FusedHeadCheck(trainer.model)
    trainer.train()
    check.remove()
    losses = logged(trainer)
    assert len(check.calls) == len(losses) == 3
    assert losses == pytest.approx([trl for trl, _ in check.calls], rel=1e-5)  # the logged loss is the checked one
    assert all(math.isfinite(loss) for loss in losses)
    if variant == "plain":
        changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
        assert "model.embed_tokens.weight" in changed and "model.decode_proj.weight" in changed
        return
    weights = dict(trainer.model.named_parameters())
    adapters = {n for n in weights if ADAPTER_WEIGHTS[variant] in n}
    assert adapters and all(weights[n].requires_grad for n in adapters)
    # the base weights stay (the table the head is tied to included), the adapters move
    bases = {base_weight_name(name): weight for name, weight in weights.items() if base_weight_name(name) in before}
    assert "model.embed_tokens.weight" in bases and "model.decode_proj.weight" in bases
    for name, weight in bases.items():
        assert torch.equal(weight.detach(), before[name]), name
    assert all(not torch.equal(weights[n].detach(), start[n]) for n in adapters), "an adapter did not train"


def test_dpo_trainer_trains_a_gpn(gpn_folder, tokenizer, tmp_path):
    """DPOTrainer on preference pairs: the policy's and the reference's log-probabilities are the model's own
    (checked on every policy call), the first loss is log 2 (the policy starts as the reference), and it learns."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    pairs = Dataset.from_dict(
        {
            "prompt": ["the cat", "a dog", "once upon", "the end"],
            "chosen": [" sat on the mat.", " sat on the log.", " a time.", "."],
            "rejected": [" dog dog.", " mat mat.", " end end.", " cat cat."],
        }
    )
    args = DPOConfig(
        **common_arguments(tmp_path, max_steps=3, learning_rate=1e-2), per_device_train_batch_size=4, max_length=32
    )
    trainer = DPOTrainer(model=gpn_folder, args=args, train_dataset=pairs)
    assert type(trainer.model).__name__ == "GPNForCausalLM" and type(trainer.ref_model).__name__ == "GPNForCausalLM"
    check = FusedHeadCheck(trainer.model)
    trainer.train()
    check.remove()
    losses = logged(trainer)
    assert len(losses) == 3 and len(check.calls) >= 3
    assert losses[0] == pytest.approx(math.log(2), abs=1e-5)
    assert losses[-1] < losses[0]


def alone_log_probs(model, prompt_ids: list[int], completion_ids: list[int]) -> float:
    """Sum of log p(completion | prompt) from the plain forward on the unpadded sequence alone."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = type(model).forward(model, ids).logits[0].float()
    picked = F.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
    return float(picked[len(prompt_ids) - 1 :].sum())


REFERENCES = {  # DPO's reference -> the policy's PEFT adapter (disabled, it is the reference)
    "separate model": None,
    "adapter disabled": dict(target_modules="all-linear"),
    "embedding adapter disabled": dict(target_modules=["embed_tokens", "decode_proj"]),
    "precomputed": None,
}


DPO_LOSSES = {"sigmoid": 1.0, "hinge": 0.5, "ipo": 0.25, "sft": 0.1}  # (a list of TRL's loss types, weighted)


def dpo_loss_by_hand(
    loss_type: str, beta: float, logps: torch.Tensor, ref_logps: torch.Tensor, lengths
) -> torch.Tensor:
    """One of TRL's DPO losses from each pair's summed log-probabilities, (pairs, 2) for chosen and rejected, and its
    completions' token counts, as the papers TRL cites define them."""
    ratios = logps - ref_logps
    delta = ratios[:, 0] - ratios[:, 1]
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta).mean()
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta).mean()
    if loss_type == "ipo":  # (TRL averages the log-ratios over each completion's tokens)
        averaged = ratios[:, 0] / lengths[:, 0] - ratios[:, 1] / lengths[:, 1]
        return ((averaged - 1 / (2 * beta)) ** 2).mean()
    assert loss_type == "sft"  # the chosen completions' mean token NLL
    return -logps[:, 0].sum() / lengths[:, 0].sum()


@pytest.mark.parametrize("reference", REFERENCES)
def test_dpo_rewards_are_log_ratios_of_each_pair_alone(gpn_folder, tokenizer, tmp_path, reference):
    """DPO's reference paths (a separate model; `ref_model=None` with a LoRA, whose disabled adapter is the
    reference, on the embedding too, which the output and TRL's head follow; `precompute_ref_log_probs`): the
    first step's loss and rewards equal beta * (policy - reference) log-probabilities of each pair computed alone,
    from the plain forward of the models the trainer holds. Rows cut to `max_length` from the start
    (`truncation_mode="keep_end"`: a row begins inside its prompt) and padded to a multiple of 8 are read as the
    kept tokens alone; with a separate reference the loss is a weighted list of TRL's loss types."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    pairs = Dataset.from_dict(
        {
            "prompt": ["the cat", "a dog", "once upon a time", "the end"],
            "chosen": [" sat on the mat.", " sat.", " there was a cat.", "."],
            "rejected": [" dog dog.", " mat mat mat.", " end.", " cat cat."],
        }
    )
    beta, max_length = 0.5, 8
    losses = DPO_LOSSES if reference == "separate model" else {"sigmoid": 1.0}
    args = DPOConfig(
        **common_arguments(tmp_path, max_steps=1),
        per_device_train_batch_size=4,
        max_length=max_length,
        truncation_mode="keep_end",
        pad_to_multiple_of=8,
        beta=beta,
        loss_type=list(losses),
        loss_weights=list(losses.values()),
        precompute_ref_log_probs=reference == "precomputed",
    )
    adapter = REFERENCES[reference]
    ref_model = gpn(tokenizer, seed=17).eval() if adapter is None else None
    peft_config = None
    if adapter is not None:  # adapters that move the policy away from the base model at once
        peft_config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **adapter)
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(gpn_folder),
        ref_model=ref_model,
        args=args,
        train_dataset=pairs,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    policy = trainer.model.get_base_model() if peft_config else trainer.model
    logps, ref_logps, lengths, cut = [], [], [], 0
    for row in trainer.train_dataset:
        for side in ("chosen_ids", "rejected_ids"):
            completion = row[side]
            prompt = row["prompt_ids"][-(max_length - len(completion)) :]  # what keep_end leaves of it
            cut += len(prompt) < len(row["prompt_ids"])
            logps.append(alone_log_probs(policy, prompt, completion))
            if peft_config:
                with trainer.model.disable_adapter():
                    ref_logps.append(alone_log_probs(policy, prompt, completion))
            else:
                ref_logps.append(alone_log_probs(ref_model, prompt, completion))
            lengths.append(len(completion))
    assert cut and max(lengths) < max_length  # some prompts cut, no completion
    logps, ref_logps, lengths = (torch.tensor(x).view(-1, 2) for x in (logps, ref_logps, lengths))
    chosen, rejected = (beta * (logps - ref_logps)).unbind(1)
    assert (chosen - rejected).abs().max() > 1e-3  # the check means something
    trainer.train()
    first = trainer.state.log_history[0]
    assert first["rewards/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-6, abs=1e-5)
    assert first["rewards/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-6, abs=1e-5)
    loss = sum(weight * dpo_loss_by_hand(kind, beta, logps, ref_logps, lengths) for kind, weight in losses.items())
    assert first["loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-5)


@pytest.mark.parametrize("adapter", ["none", "lora on the embedding"])
def test_grpo_log_probs_of_padded_rows_equal_each_sequence_alone(gpn_folder, tmp_path, adapter):
    """GRPO scores left-padded prompts of different lengths followed by right-padded completions (padding at both
    ends of a row, to a multiple of 8), for the policy, the reference (`beta` > 0) and the old policy (one
    generation for two steps), at the sampling temperature: every per-token log-probability equals the plain forward's
    on that prompt and completion alone. With a LoRA on the embedding (the reference: its adapter disabled), TRL's
    head follows the adapted table, as the forward does; without one, `cast_lm_head_to_fp32` (TRL replaces the
    head's forward and hooks the embedding) changes none of it. (The loss type, sequence-level importance sampling
    and weighted rewards are TRL's arithmetic on these log-probabilities.)"""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    def reward_length(completions, **kwargs):
        return [0.1 * len(completion) for completion in completions]

    def reward_cat(completions, **kwargs):
        return [float("cat" in completion) for completion in completions]

    args = GRPOConfig(
        **common_arguments(tmp_path, max_steps=1),
        use_vllm=False,
        num_generations=4,
        max_completion_length=6,
        per_device_train_batch_size=4,
        generation_batch_size=8,
        beta=0.1,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        pad_to_multiple_of=8,
        loss_type="dr_grpo",
        importance_sampling_level="sequence",
        reward_weights=[1.0, 0.5],
        cast_lm_head_to_fp32=adapter == "none",
    )
    prompts = Dataset.from_dict({"prompt": ["the cat", "a dog sat on the", "once upon a time there", "the"]})
    peft_config = None
    if adapter != "none":
        peft_config = LoraConfig(
            r=4, lora_alpha=1, target_modules=["embed_tokens", "decode_proj"], init_lora_weights=False
        )
    trainer = GRPOTrainer(
        model=gpn_folder,
        reward_funcs=[reward_length, reward_cat],
        args=args,
        train_dataset=prompts,
        peft_config=peft_config,
    )
    scored = trainer._get_per_token_logps_and_entropies
    compared = []

    def compare_with_each_alone(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        logps, entropies, aux = scored(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        for row, mask, row_logps in zip(input_ids, attention_mask, logps):
            real = mask.bool()
            n = int(real[-logits_to_keep:].sum())  # the completion's real tokens
            ids = row[real][None]
            with torch.no_grad():
                logits = type(model).forward(model, ids).logits[0].float() / trainer.temperature
            alone = F.log_softmax(logits[:-1], dim=-1).gather(-1, ids[0, 1:, None])[:, 0][-n:]
            torch.testing.assert_close(row_logps[real[-logits_to_keep:]].float(), alone, rtol=1e-5, atol=1e-5)
            compared.append(bool((~real[:-logits_to_keep]).any()))  # a left-padded prompt
        return logps, entropies, aux

    trainer._get_per_token_logps_and_entropies = compare_with_each_alone
    trainer.train()
    # the old policy's rows (8: one generation for two steps), the reference's (8) and the policy's (4), some with
    # padded prompts
    assert len(compared) == 20 and any(compared)


def test_distillation_trainer_distils_a_gpn_teacher_into_a_gpn(gpn_folder, tokenizer, tmp_path):
    """DistillationTrainer (student and teacher both GPNs, on-policy completions from the student's `generate()`):
    TRL gives the base model the causal LM's `logits_to_keep` (it was refused by name, so the trainer failed at its
    first step), and keeps the positions itself: the base model's output is the same with it as without."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    base_calls = []

    def same_without_logits_to_keep(module, args, kwargs, output):
        if "logits_to_keep" in kwargs:
            rest = {k: v for k, v in kwargs.items() if k != "logits_to_keep"}
            with torch.no_grad():
                plain = type(module).forward(module, *args, **rest).last_hidden_state
            torch.testing.assert_close(output.last_hidden_state, plain, rtol=1e-5, atol=1e-6)
            base_calls.append(kwargs["logits_to_keep"])

    completions = Dataset.from_dict(
        {"prompt": ["the cat", "a dog", "once upon", "the end"], "completion": [" sat.", " sat.", " a time.", "."]}
    )
    args = DistillationConfig(
        **common_arguments(tmp_path, max_steps=1), per_device_train_batch_size=4, max_completion_length=4
    )
    teacher = gpn(tokenizer, seed=17)
    trainer = DistillationTrainer(
        model=gpn_folder, teacher_model=teacher, args=args, train_dataset=completions, processing_class=tokenizer
    )
    handles = [
        m.model.register_forward_hook(same_without_logits_to_keep, with_kwargs=True) for m in (trainer.model, teacher)
    ]
    trainer.train()
    for handle in handles:
        handle.remove()
    assert len(base_calls) >= 2 and all(isinstance(kept, int) and kept > 1 for kept in base_calls)
    loss = logged(trainer)
    assert len(loss) == 1 and math.isfinite(loss[0]) and loss[0] > 0  # (a teacher other than the student)


# --------------------------------------------------------------------------------------------------
# Reward models and sequence classification
# --------------------------------------------------------------------------------------------------


def test_reward_trainer_trains_a_gpn_reward_model(tokenizer, tmp_path):
    """RewardTrainer on chosen/rejected pairs with a `GPNForSequenceClassification(num_labels=1)`: each step's loss
    is -log sigmoid(r_chosen - r_rejected - margin) + c * mean((r_chosen + r_rejected)^2) of the model's own scores
    on that batch (the dataset's `margin` column, which TRL passes to the model with the batch;
    `center_rewards_coefficient` c), and the chosen ones win."""
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    from modeling_gpn import GPNForSequenceClassification

    config = tiny_config(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_labels=1,
    )
    torch.manual_seed(6)
    model = GPNForSequenceClassification(config)
    pairs = Dataset.from_dict(
        {
            "chosen": ["the cat sat on the mat.", "a cat.", "the cat and the mat.", "once upon a time a cat sat."],
            "rejected": ["the dog dog dog.", "a dog log.", "the end end end end.", "a log."],
            "margin": [0.5, 0.0, 0.25, 1.0],
        }
    )
    args = RewardConfig(
        **common_arguments(tmp_path, max_steps=6, learning_rate=1e-2),
        per_device_train_batch_size=4,
        max_length=32,
        center_rewards_coefficient=0.3,
    )
    trainer = RewardTrainer(model=model, args=args, train_dataset=pairs, processing_class=tokenizer)
    seen = []

    def own_loss(module, args, kwargs, output):
        with torch.no_grad():  # each row alone, unpadded, scored at its last token (EOS, which is also the pad token)
            scores = [
                module.score(module.model(row[None, :n]).last_hidden_state[0, -1])[0]
                for row, n in zip(kwargs["input_ids"], kwargs["attention_mask"].sum(1))
            ]
        chosen, rejected = torch.stack(scores).chunk(2)
        centring = 0.3 * ((chosen + rejected) ** 2).mean()
        seen.append(float(-F.logsigmoid(chosen - rejected - kwargs["margin"]).mean() + centring))

    handle = trainer.model.register_forward_hook(own_loss, with_kwargs=True)
    trainer.train()
    handle.remove()
    losses = logged(trainer)
    assert len(losses) == 6
    assert losses == pytest.approx(seen[: len(losses)], rel=1e-4)  # scores at the last real token: the unpadded rows'
    assert losses[-1] < losses[0] and logged(trainer, "accuracy")[-1] == 1.0


# A chat template whose turns end with EOS, which is also the pad token, then a newline: the pad id inside the text
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def test_a_lora_reward_model_trained_on_conversations_scores_grpo_completions(gpn_folder, tokenizer, tmp_path):
    """TRL's documented path for a reward model, then its use in GRPO: `RewardTrainer` given the causal-LM folder (it
    builds `AutoModelForSequenceClassification`, the score head new: the load report names it, the rest loaded) and a
    chat-template tokenizer, on conversations, with `LoraConfig(task_type="SEQ_CLS")` (PEFT finds the head by its
    name, `score`, trains and saves it): every score is the model's own at the row's last real token, the adapter
    reloads (`AutoPeftModelForSequenceClassification`) and merges to the trained scores; merged, it is
    `GRPOTrainer`'s reward model (with its tokenizer) for a GPN policy trained without vLLM: completions come from the
    policy's own `generate()`, each reward equals the model's score of that conversation alone, the logged mean reward
    is theirs, the policy's log-probabilities are its own (every fused call checked) and its weights move. (GRPO
    with a reward function: docs/fine-tuning.md's snippet, run by `test_fine_tuning_doc_snippets_run`.)"""
    import copy

    from datasets import Dataset
    from peft import AutoPeftModelForSequenceClassification, LoraConfig
    from transformers import AutoModelForSequenceClassification
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as transformers_logging
    from trl import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE

    def turn(question, answer):
        return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    questions = ["the cat?", "a cat?", "the end?", "once?"]
    good = ["the cat sat on the mat.", "a cat.", "the cat and the mat.", "once upon a time a cat sat."]
    bad = ["the dog dog dog.", "a dog log.", "the end end end end.", "a log."]
    pairs = Dataset.from_dict({"chosen": list(map(turn, questions, good)), "rejected": list(map(turn, questions, bad))})
    args = RewardConfig(
        **common_arguments(tmp_path / "reward", max_steps=2, learning_rate=1e-2),
        per_device_train_batch_size=4,
        max_length=64,
    )
    lora = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["fuse_proj", "decode_proj"])
    trainer = RewardTrainer(model=gpn_folder, args=args, train_dataset=pairs, processing_class=chat, peft_config=lora)
    scorer = trainer.model.get_base_model()
    assert type(scorer).__name__ == "GPNForSequenceClassification" and scorer.config.num_labels == 1
    assert "base_model.model.score.modules_to_save.default.weight" in dict(trainer.model.named_parameters())

    def own_scores(model, ids, mask):
        with torch.no_grad():  # each row alone, unpadded
            return torch.cat(
                [model.score(model.model(row[None, :n]).last_hidden_state[:, -1]) for row, n in zip(ids, mask.sum(1))]
            )

    differences = []

    def check(module, args, kwargs, output):
        expected = own_scores(module.get_base_model(), kwargs["input_ids"], kwargs["attention_mask"])
        differences.append(float((output.logits.detach() - expected).abs().max()))

    handle = trainer.model.register_forward_hook(check, with_kwargs=True)
    trainer.train()
    handle.remove()
    assert len(differences) == 2 and max(differences) < 1e-5
    trained = trainer.model.eval()
    trainer.save_model(tmp_path / "adapter")

    logger = transformers_logging.get_logger("transformers.modeling_utils")
    with CaptureLogger(logger) as report:
        fresh, info = AutoModelForSequenceClassification.from_pretrained(
            gpn_folder, num_labels=1, output_loading_info=True
        )
    assert info["missing_keys"] == {"score.weight"} and not info["unexpected_keys"], info
    assert "score.weight" in report.out and "MISSING" in report.out
    reloaded = AutoPeftModelForSequenceClassification.from_pretrained(tmp_path / "adapter", num_labels=1).eval()
    sample = chat.apply_chat_template(turn("the cat?", "the cat sat."), return_tensors="pt", return_dict=True)
    with torch.no_grad():
        want = trained(**sample).logits
        assert not torch.allclose(fresh.eval()(**sample).logits, want)
        torch.testing.assert_close(reloaded(**sample).logits, want, rtol=1e-5, atol=1e-6)
        reward_model = reloaded.merge_and_unload()
        torch.testing.assert_close(reward_model(**sample).logits, want, rtol=1e-5, atol=1e-6)

    rewards = []

    def scored(module, args, kwargs, output):
        expected = own_scores(module, kwargs["input_ids"], kwargs["attention_mask"])[:, 0]
        torch.testing.assert_close(output.logits[:, 0], expected, rtol=1e-5, atol=1e-6)
        assert bool((kwargs["input_ids"][:, 0] != chat.pad_token_id).all())  # (right-padded conversations)
        rewards.append(expected)

    grpo_args = GRPOConfig(
        **common_arguments(tmp_path / "grpo", max_steps=1),
        use_vllm=False,
        num_generations=2,
        max_completion_length=6,
        per_device_train_batch_size=4,
    )
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in questions]})
    handle = reward_model.register_forward_hook(scored, with_kwargs=True)
    grpo = GRPOTrainer(
        model=gpn_folder,
        reward_funcs=reward_model,
        reward_processing_classes=chat,
        args=grpo_args,
        train_dataset=prompts,
        processing_class=chat,
    )
    before = {n: p.detach().clone() for n, p in grpo.model.named_parameters()}
    fused = FusedHeadCheck(grpo.model)  # the policy's log-probabilities of its completions: its own
    grpo.train()
    fused.remove()
    handle.remove()
    assert fused.calls and logged(grpo, "completions/mean_length")[0] > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in grpo.model.named_parameters())
    assert len(rewards) == 1 and rewards[0].numel() == 4
    name = reward_model.config.name_or_path.split("/")[-1]
    assert logged(grpo, f"rewards/{name}/mean")[0] == pytest.approx(rewards[0].mean().item(), rel=1e-5, abs=1e-7)


def test_trainer_fine_tunes_sequence_classification_on_a_tiny_labelled_set(tokenizer, tmp_path):
    """transformers' Trainer with DataCollatorWithPadding: the first loss is the cross-entropy of the model's own
    scores at each row's last real token, the loss falls, and the classifier learns the labels."""
    from datasets import Dataset
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    from modeling_gpn import GPNForSequenceClassification

    texts = ["the cat sat.", "a cat.", "the cat and a mat.", "a dog.", "the dog sat on the log.", "the end dog."]
    labels = [1, 1, 1, 0, 0, 0]
    encoded = Dataset.from_dict({"text": texts, "label": labels})
    encoded = encoded.map(lambda row: tokenizer(row["text"]), remove_columns="text")
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=2)
    torch.manual_seed(7)
    model = GPNForSequenceClassification(config).train()
    with torch.no_grad():
        alone = torch.cat([model(**tokenizer(text, return_tensors="pt")).logits for text in texts])
        first = F.cross_entropy(alone, torch.tensor(labels))
    args = TrainingArguments(
        **common_arguments(tmp_path, max_steps=12, learning_rate=1e-2), per_device_train_batch_size=6
    )
    trainer = Trainer(model=model, args=args, train_dataset=encoded, data_collator=DataCollatorWithPadding(tokenizer))
    trainer.train()
    losses = logged(trainer)
    assert losses[0] == pytest.approx(first.item(), rel=1e-4)  # padded batch == each text alone
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        assert model.eval()(**batch).logits.argmax(-1).tolist() == labels


# --------------------------------------------------------------------------------------------------
# docs/fine-tuning.md
# --------------------------------------------------------------------------------------------------


def test_fine_tuning_doc_snippets_run(tmp_path):
    """Every Python snippet of docs/fine-tuning.md, in order, in a fresh process (TRL's configs default to bf16,
    which would fix this process's Accelerate state): the page's claim that they run as they are."""
    import re
    import subprocess
    import sys

    from ..environment import REPO_ROOT

    page = REPO_ROOT / "docs" / "fine-tuning.md"
    snippets = re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL)
    assert len(snippets) >= 7
    script = tmp_path / "snippets.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + "\n".join(snippets))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    for folder in ("tiny-gpn", "sft", "sft-packed", "sft-lora", "dpo", "grpo", "reward", "classify"):
        assert (tmp_path / folder).is_dir(), folder
