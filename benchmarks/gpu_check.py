"""CUDA correctness of the fast path (fast == plain in fp32, bf16 tracks fp32), run by gpu_check.sh.

Prints one line per check and exits non-zero if any fails.
"""

from __future__ import annotations

import sys

import torch

from modeling_gpn import GPNConfig, GPNForCausalLM


def perturbed(config, device, seed=0):
    torch.manual_seed(seed)
    model = GPNForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
            elif "embed" not in name:
                param.copy_(0.5 * torch.randn_like(param) / param.shape[1] ** 0.5)
    return model.to(device)


def tiny(**overrides):
    values = dict(vocab_size=97, hidden_size=48, embedding_size=32, intermediate_size=64, num_memory_heads=3,
                  memory_key_dim=8, memory_value_dim=16, eos_token_id=0, bos_token_id=None)
    values.update(overrides)
    return GPNConfig(**values)


def grads_of(model, fast, ids, mask):
    model.model.use_fast_path = fast
    model.zero_grad(set_to_none=True)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), return_logits=not fast)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    failures = 0
    variants = {"gpn+m": {}, "gpn": dict(use_memory=False), "2l-bias": dict(num_predict_layers=2, use_decoder_bias=True),
                "gpn+m-seg5-trunc8": dict(bptt_segment_length=5, bptt_truncation_length=8)}
    for name, kw in variants.items():
        model = perturbed(tiny(**kw), device).train()
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 97, (4, 63), generator=g).to(device)
        mask = (torch.rand(4, 63, generator=g) > 0.2).long().to(device)
        plain_loss, plain = grads_of(model, False, ids, mask)
        fast_loss, fast = grads_of(model, True, ids, mask)
        worst = max(((fast[k] - plain[k]).abs().max() / plain[k].abs().max().clamp_min(1e-6)).item() for k in plain)
        ok = abs(fast_loss - plain_loss).item() < 1e-4 and worst < 1e-3
        failures += not ok
        print(f"[{'ok' if ok else 'FAIL'}] {device} fp32 fast == plain ({name}): loss diff {abs(fast_loss - plain_loss).item():.2e}, worst relative grad diff {worst:.2e}")
    config = tiny()
    reference = perturbed(config, device, seed=3).eval()
    low = perturbed(config, device, seed=3).to(torch.bfloat16).eval()
    ids = torch.randint(0, 97, (2, 512), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        reference.model.use_fast_path = False
        expected = reference(ids).logits.float().log_softmax(-1)
        got = low(ids).logits.float().log_softmax(-1)
    diff = (got - expected).abs()
    ok = diff.max().item() < 0.1 and diff.mean().item() < 0.02
    failures += not ok
    print(f"[{'ok' if ok else 'FAIL'}] {device} bf16 fast vs fp32 plain over 512 tokens: max |dlogp| {diff.max().item():.4f}, mean {diff.mean().item():.5f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
