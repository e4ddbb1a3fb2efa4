"""`python -m hsx.demo` regenerates the shipped demo assets in this folder, training the model's weights.

The script sits above both the generators (`hsx.demo`) and the training (`hsx.demo.train`, which reads the
generated chats), so neither imports the other back."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from hsx.demo import build_model, build_tokenizer, chat_rows
from hsx.demo.train import train_target


def write_demo(root: str | os.PathLike[str], train: bool = True) -> None:
    """Write ``root/chat.jsonl`` and ``root/tiny-qwen3/`` (tokenizer + 8-layer bf16 safetensors model).

    ``train``: train the weights on generated chats (``hsx.demo.train``; ``chat.jsonl`` is held out) instead of
    keeping the seeded random initialisation.
    """
    root = Path(root)
    model_dir = root / "tiny-qwen3"
    # Start from an empty folder so no stale file from an older layout survives.
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)

    rows = chat_rows()
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(model_dir)
    model = build_model(tokenizer, num_layers=8)
    if train:
        train_target(model, tokenizer, held_out=rows)
    model.to(torch.bfloat16).save_pretrained(model_dir, safe_serialization=True)
    # save_pretrained writes the weights through a private temp file (mode 0600); make the shipped
    # files world-readable so installed copies load for every user.
    for path in model_dir.iterdir():
        path.chmod(0o644)

    with open(root / "chat.jsonl", "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    """Regenerate the shipped assets next to this file."""
    write_demo(Path(__file__).parent)


if __name__ == "__main__":
    main()
