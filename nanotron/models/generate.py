"""Text from a model, one token at a time: greedy or sampled (temperature, top-k, nucleus), no KV cache."""

from __future__ import annotations

import torch

from nanotron.models.llama import LlamaForCausalLM


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> int:
    """Greedy at temperature 0; otherwise a draw from the softmax restricted to the top-k / nucleus. A vanishing
    temperature or top_p tends to the greedy choice and stays finite: float64 holds any positive float the flags take
    (float32 rounds 1e-300 to 0: no token left in the nucleus), and the logits shifted to a maximum of 0 can only
    underflow to -inf when divided by it, never overflow to inf."""
    if temperature == 0:
        return int(logits.argmax())
    logits = (logits.double() - logits.max()) / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        outside = probs.cumsum(-1) - probs >= top_p  # tokens after the nucleus is already full
        logits = logits.scatter(0, order[outside], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """New token ids after `prompt_ids`; the context is cut to the model's max_seq_len (no KV cache)."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    window = model.config.max_seq_len
    for _ in range(max_new_tokens):
        context = torch.tensor([ids[-window:]], device=device)
        next_id = sample_next(model(context)[0, -1], temperature, top_k, top_p, generator)
        ids.append(next_id)
        if next_id == eos_id:
            break
    return ids[len(prompt_ids) :]
