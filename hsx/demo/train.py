"""Train the demo target's weights on chats from the demo generator, so its next-token distribution is peaked.

The demo conversations are pool words drawn uniformly at random, so a trained model can only be sure where the
text is: inside a word, the chat markup, capitals after a full stop. Word starts stay uncertain (about log 250
nats a word). The training rows come from ``chat_rows`` with a different seed than the shipped ``chat.jsonl``, so
that file is held out: its loss is what ``train_target`` reports.

Runs on a CPU (``python -m hsx.demo``; docs/benchmarks.md has its time and losses). The data, the initialisation
and the batches are seeded; torch's CPU kernels decide whether a rerun is bit-identical.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

__all__ = ["TrainConfig", "encode_rows", "held_out_loss", "train_target"]


@dataclass(frozen=True)
class TrainConfig:
    rows: int = 2000  # generated training conversations (chat_rows seed below; chat.jsonl is seed 0)
    data_seed: int = 1
    seed: int = 0
    steps: int = 400
    batch: int = 8
    window: int = 192  # tokens a training window; each starts at a conversation start
    lr: float = 5e-3
    warmup: int = 30
    weight_decay: float = 0.01


def encode_rows(tokenizer: transformers.PreTrainedTokenizerBase, rows: list[dict[str, Any]]) -> list[list[int]]:
    """Each usable row's chat-template text as token ids (the same ids an hsx job tokenizes)."""
    out: list[list[int]] = []
    for row in rows:
        messages = row.get("messages") or []
        if not any(m.get("role") == "assistant" and isinstance(m.get("content"), str) for m in messages):
            continue
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def _windows(stream: torch.Tensor, starts: torch.Tensor, window: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    pick = starts[torch.randint(len(starts), (batch,), generator=gen)]
    return torch.stack([stream[s : s + window + 1] for s in pick.tolist()])


@torch.no_grad()
def held_out_loss(model: transformers.PreTrainedModel, rows: list[list[int]]) -> tuple[float, float]:
    """Mean next-token cross-entropy and mean entropy of the model's next-token distribution (nats) over ``rows``."""
    model.eval()
    ce_sum = ent_sum = 0.0
    n = 0
    for ids in rows:
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0, :-1].float()
        logp = logits.log_softmax(-1)
        ce_sum += F.nll_loss(logp, x[0, 1:], reduction="sum").item()
        ent_sum += -(logp.exp() * logp).sum().item()
        n += len(ids) - 1
    return ce_sum / n, ent_sum / n


def train_target(
    model: transformers.PreTrainedModel,
    tokenizer: transformers.PreTrainedTokenizerBase,
    held_out: list[dict[str, Any]],
    cfg: TrainConfig = TrainConfig(),
    log: Any = print,
) -> dict[str, float]:
    """Train ``model`` (float32, in place) on ``cfg.rows`` generated chats; return the held-out numbers."""
    from hsx.demo import chat_rows

    train_ids = encode_rows(tokenizer, chat_rows(cfg.rows, seed=cfg.data_seed))
    held_ids = encode_rows(tokenizer, held_out)
    lengths = torch.tensor([len(r) for r in train_ids])
    stream = torch.tensor([t for r in train_ids for t in r])
    starts = torch.cumsum(lengths, 0) - lengths
    starts = starts[starts + cfg.window + 1 <= len(stream)]

    before = held_out_loss(model, held_ids)
    log(f"{len(train_ids)} training rows, {len(stream):,} tokens; held-out {len(held_ids)} rows: "
        f"loss {before[0]:.3f}, entropy {before[1]:.3f} nats before training")
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    t0 = time.monotonic()
    model.train()
    running = 0.0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = _windows(stream, starts, cfg.window, cfg.batch, gen)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % 100 == 0:
            log(f"step {step + 1}/{cfg.steps}: train loss {running / 100:.3f} ({time.monotonic() - t0:.0f} s)")
            running = 0.0
    after = held_out_loss(model, held_ids)
    model.eval()
    log(f"held-out loss {after[0]:.3f}, entropy {after[1]:.3f} nats after {cfg.steps} steps "
        f"({time.monotonic() - t0:.0f} s)")
    return {"loss_before": before[0], "entropy_before": before[1], "loss_after": after[0], "entropy_after": after[1]}

