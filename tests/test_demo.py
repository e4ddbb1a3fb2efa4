"""The shipped demo target predicts the held-out demo chats, and the script that trains it lowers the loss."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from helpers import REPO
from hsx.demo import build_model, build_tokenizer, chat_rows
from hsx.demo.train import TrainConfig, encode_rows, held_out_loss, train_target

DEMO = REPO / "hsx" / "demo"


@pytest.mark.slow
def test_shipped_target_is_peaked_on_held_out_chats():
    """chat.jsonl is not in the training data; a random-weight target scores ~6.2 nats (uniform over 512: 6.24)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO / "tiny-qwen3")
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO / "tiny-qwen3", dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (DEMO / "chat.jsonl").read_text().splitlines()[:12]]
    loss, entropy = held_out_loss(model, encode_rows(tokenizer, rows))
    assert loss < 2.5 and entropy < 2.5, (loss, entropy)


def test_training_rows_skip_unusable_chats_and_are_not_the_shipped_ones():
    tokenizer = build_tokenizer()
    shipped = encode_rows(tokenizer, chat_rows())
    assert len(shipped) == 96  # the 3 deliberately bad rows are left out
    assert not set(map(tuple, encode_rows(tokenizer, chat_rows(50, seed=TrainConfig().data_seed)))) & set(
        map(tuple, shipped))


def test_train_target_lowers_the_held_out_loss():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, num_layers=1, hidden_size=32)
    cfg = TrainConfig(rows=40, steps=30, batch=4, window=64, warmup=5)
    got = train_target(model, tokenizer, held_out=chat_rows(4, seed=7), cfg=cfg, log=lambda _: None)
    assert got["loss_after"] < got["loss_before"] - 1.0, got
