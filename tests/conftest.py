"""Shared fixtures: tiny random models and small datasets built in-process, once per session. CPU only, offline."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

# Before anything imports huggingface_hub / datasets / transformers: no network, a private datasets cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "HF_DATASETS_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="hsx-tests-datasets-cache-")
    os.environ["HF_DATASETS_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# A hand-checked multi-turn conversation with a system prompt (see test_data.py for the expected rendering).
HAND_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather today?"},
    {"role": "assistant", "content": "The weather today is sunny."},
    {"role": "user", "content": "And the river?"},
    {"role": "assistant", "content": "The river is quiet, and the water is warm."},
]
LONG_USER = " ".join(["The quick brown fox jumps over the lazy dog near the quiet river bank."] * 20)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


@dataclass
class TinyModel:
    path: Path  # save_pretrained folder (float32 safetensors + tokenizer)
    model: Any  # the float32 Qwen3ForCausalLM, eval mode (the reference)
    tokenizer: Any
    num_layers: int
    hidden: int
    _ref_models: dict = field(default_factory=dict, repr=False)

    def reference(self, ids: list[int], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The full-depth model on ONE sample, unpadded: {layer i: (T, hidden)} for every i, and 'final'.

        output_hidden_states[i+1] for i < N-1, a forward hook for the pre-norm output of layer N-1,
        hidden_states[N] (after the final norm) for 'final'."""
        model = self._ref_models.get(dtype)
        if model is None:
            model = self.model if dtype == torch.float32 else _load_full(self.path, dtype)
            self._ref_models[dtype] = model
        n = self.num_layers
        captured: dict[str, torch.Tensor] = {}

        def hook(module, args, output):
            captured["last"] = output[0] if isinstance(output, tuple) else output

        handle = model.model.layers[n - 1].register_forward_hook(hook)
        try:
            with torch.no_grad():
                out = model(torch.tensor([list(ids)], dtype=torch.long), output_hidden_states=True, use_cache=False)
        finally:
            handle.remove()
        hs = out.hidden_states
        assert len(hs) == n + 1
        ref = {i: hs[i + 1][0].float() for i in range(n - 1)}
        ref[n - 1] = captured["last"][0].float()
        ref["final"] = hs[n][0].float()
        return ref


def _load_full(path: Path, dtype: torch.dtype):
    """The full CausalLM from the saved folder in `dtype`, as a user would load it (buffers such as rotary
    inv_freq stay float32, unlike `.to(dtype)`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _save_tiny_model(root: Path, tokenizer, num_layers: int, hidden: int = 64, seed: int = 0) -> TinyModel:
    from hsx.demo import build_model

    model = build_model(tokenizer, num_layers=num_layers, hidden_size=hidden, dtype=torch.float32, seed=seed)
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    return TinyModel(path=root, model=model, tokenizer=tokenizer, num_layers=num_layers, hidden=hidden)


@pytest.fixture(scope="session")
def tokenizer():
    from hsx.demo import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_no_generation():
    from hsx.demo import CHAT_TEMPLATE_NO_GENERATION, build_tokenizer

    return build_tokenizer(CHAT_TEMPLATE_NO_GENERATION)


@pytest.fixture(scope="session")
def model8(tmp_path_factory, tokenizer) -> TinyModel:
    """8 decoder layers, hidden 64 (so every preset gives distinct layers)."""
    return _save_tiny_model(tmp_path_factory.mktemp("model8"), tokenizer, num_layers=8)


@pytest.fixture(scope="session")
def model4(tmp_path_factory, tokenizer) -> TinyModel:
    """4 decoder layers, hidden 64: the cheap one for CLI runs."""
    return _save_tiny_model(tmp_path_factory.mktemp("model4"), tokenizer, num_layers=4, seed=1)


@pytest.fixture(scope="session")
def no_template_tokenizer_dir(tmp_path_factory) -> Path:
    from hsx.demo import build_tokenizer

    root = tmp_path_factory.mktemp("tok-no-template")
    build_tokenizer(chat_template=None).save_pretrained(root)
    return root


# ---- datasets --------------------------------------------------------------------------------------------------

@dataclass
class ChatData:
    path: Path
    rows: list[dict[str, Any]]
    skip: dict[int, str]  # sample_id -> expected skip reason (before the max_length cut)


def mixed_chat_rows() -> tuple[list[dict[str, Any]], dict[int, str]]:
    """Good chat rows of many lengths plus one row per bad-input case, interleaved."""
    from hsx.demo import chat_rows

    good = chat_rows(28, seed=7)[:28]
    rows: list[dict[str, Any]] = [{"messages": HAND_CONVERSATION}]
    rows += good[:10]
    skip: dict[int, str] = {}

    def bad(row, reason):
        skip[len(rows)] = reason
        rows.append(row)

    bad({"messages": []}, "empty_conversation")
    bad({"messages": [{"role": "user", "content": "Is anyone there?"}]}, "no_assistant_turn")
    bad({"messages": [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": None}]},
        "null_content")
    bad({"messages": None}, "missing_value")
    rows += good[10:20]
    # Long prompt, then the answer: the answer falls after max_length -> nothing supervised is left.
    bad({"messages": [{"role": "user", "content": LONG_USER}, {"role": "assistant", "content": "Yes."}]},
        "no_supervised_tokens_after_truncation")
    # Long answer: truncated but usable.
    rows.append({"messages": [{"role": "user", "content": "Tell me about the fox."},
                              {"role": "assistant", "content": LONG_USER}]})
    rows += good[20:]
    return rows, skip


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory) -> ChatData:
    rows, skip = mixed_chat_rows()
    path = write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", rows)
    return ChatData(path=path, rows=rows, skip=skip)


@pytest.fixture(scope="session")
def small_chat_path(tmp_path_factory) -> Path:
    """A few good rows and one bad one: for CLI runs."""
    from hsx.demo import chat_rows

    rows = chat_rows(6, seed=3)[:6]
    rows.insert(2, {"messages": [{"role": "user", "content": "Is anyone there?"}]})
    return write_jsonl(tmp_path_factory.mktemp("data") / "small.jsonl", rows)


@pytest.fixture(scope="session")
def broken_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "broken.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [{"role": "us\n')
    return path


@dataclass
class Expected:
    rows: dict[int, tuple[list[int], list[int], bool]]  # usable sample_id -> (input_ids, loss_mask, truncated)
    skip: dict[int, str]  # sample_id -> skip reason
    skip_counts: dict[str, int]
    truncated: int


def expected_tokenization(chat: ChatData, tokenizer, max_length: int) -> Expected:
    """What hsx should make of `chat` rows, computed straight from the tokenizer (generation markers)."""
    rows, skip = {}, dict(chat.skip)
    for sid, row in enumerate(chat.rows):
        if sid in skip:
            continue
        enc = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"])[:max_length], list(enc["assistant_masks"])[:max_length]
        truncated = len(enc["input_ids"]) > max_length
        if not any(mask):
            skip[sid] = "no_supervised_tokens_after_truncation" if truncated else "no_supervised_tokens"
            continue
        rows[sid] = (ids, mask, truncated)
    counts: dict[str, int] = {}
    for r in skip.values():
        counts[r] = counts.get(r, 0) + 1
    return Expected(rows=rows, skip=dict(sorted(skip.items())), skip_counts=dict(sorted(counts.items())),
                    truncated=sum(t for _, _, t in rows.values()))


def bucket_of(num_tokens: np.ndarray, max_length: int) -> np.ndarray:
    from hsx.buckets import bucket_bounds

    return np.searchsorted(bucket_bounds(max_length), num_tokens, side="left")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float(torch.linalg.norm(got - ref) / torch.linalg.norm(ref))


def bf16_ulps(got_bf16: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place between stored bf16 values and a float reference rounded to bf16
    (bf16 bit patterns are monotonic within a sign; values within 1e-6 of zero count as equal)."""
    a = got_bf16.to(torch.bfloat16).view(torch.int16).to(torch.int64)
    r = ref.to(torch.bfloat16)
    b = r.view(torch.int16).to(torch.int64)
    # map sign-magnitude bit patterns onto a monotonic integer line
    a = torch.where(a < 0, -(a & 0x7FFF), a)
    b = torch.where(b < 0, -(b & 0x7FFF), b)
    d = (a - b).abs()
    tiny = (got_bf16.float() - ref.float()).abs() <= 1e-6
    return torch.where(tiny, torch.zeros_like(d), d)
