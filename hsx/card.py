"""The dataset card (README.md) of an output dir and its Hub repo, through huggingface_hub's DatasetCard.

The YAML block is a `DatasetCardData`: `configs` (one `default` config whose train split is exactly the files
hsx.json lists, so `load_dataset(OUT)` reads the committed units and fails on a missing one), the job's fingerprint
(as `hsx_fingerprint` and as the config's `description`) and the tags; yaml.dump writes it, so no value read from
hsx.json can break out of a YAML string. The body says what the columns are, how to decode the states with plain
torch, and how to load them without copying. The placeholder card of an unfinished job is hsx.sink's
(UNFINISHED_CARD: it is part of the commit protocol, not a description).
"""

from __future__ import annotations

import json
import re
from typing import Any

from hsx.schema import DEFAULT_STORAGE_DTYPE, human_bytes
from hsx.info import output_bytes

BIG_OUTPUT_BYTES = 50e9  # above this (or on the Hub) the card leads with streaming / hsx.load


def data_files(info: dict[str, Any]) -> str | list[str]:
    """The train split's files: exactly those hsx.json lists (a glob only for an info without the list)."""
    files = [f"data/{f['file']}" for f in info.get("files") or []]
    return files or "data/train-*.arrow"


def card_data(info: dict[str, Any]):
    """The card's YAML block.

    The fingerprint is in it twice: `hsx_fingerprint` for people and tools, and as the config's `description`,
    which is what busts datasets' cache of local dirs: datasets 5.2 keys `load_dataset(DIR)` by the folder's name
    and the card's configs (not the path, not the files' contents or mtimes), so two outputs in folders of the
    same name (or one folder re-made by another job) returned the first one's rows; a top-level YAML key does
    not change that key, the config's description does (tests/test_load.py)."""
    from huggingface_hub import DatasetCardData

    fingerprint = info.get("fingerprint", "")
    return DatasetCardData(
        configs=[{"config_name": "default", "description": f"hsx job {fingerprint}",
                  "data_files": [{"split": "train", "path": data_files(info)}]}],
        hsx_fingerprint=fingerprint or None, tags=["hsx", "hidden-states"])


def _decode_lines(dtype: str, num_layers: int, hidden: int) -> str:
    """The plain-torch decode of one row from `with_format("torch")`, which widens the stored integer bits to
    int64 (a streaming dataset's with_format takes no dtype=): narrow them back, then reinterpret."""
    shape = f'row["num_tokens"], {num_layers}, {hidden}'
    if dtype == "bfloat16":
        return f'states = row["hidden_states"].to(torch.int16).view(torch.bfloat16).reshape({shape})'
    if dtype == "float8_e4m3":
        return (f'q = row["hidden_states"].to(torch.uint8).view(torch.float8_e4m3fn).reshape({shape})\n'
                'states = (q.float() * row["hidden_states_scale"][..., None]).to(torch.bfloat16)  # x = q * scale')
    return f'states = row["hidden_states"].reshape({shape})  # {dtype}'


STORAGE_EXACTNESS = {  # what the card says of the stored states, per --storage-dtype
    "bfloat16": "stored bit-exact as the int16 bits of bfloat16 (Arrow has no bfloat16)",
    "float16": "converted to float16 (exact for bfloat16 values with |x| in ~[6e-5, 65504]; outside it, not)",
    "float32": "stored as float32 (exact for bfloat16 and float16 compute)",
    "float8_e4m3": "quantized to float8_e4m3fn, stored as its uint8 bits with a float32 scale per token and layer "
                   "(x ≈ q * scale, lossy: a 3-bit mantissa)",
}


def dataset_card(info: dict[str, Any], command: str) -> str:
    """README.md for the output dir (and its Hub repo): card_data's YAML, then what the columns are, how to
    decode the states, and how to load them without copying. `command`: the command that made it (a Hub token
    in it is masked)."""
    from huggingface_hub import DatasetCard

    c = info["counts"]
    num_layers, hidden = len(info["layers"]), info["hidden_size"]
    layers = ", ".join(str(i) for i in info["layers"])
    dtype = info.get("storage_dtype", DEFAULT_STORAGE_DTYPE)
    cfg = info.get("config", {})
    repo = cfg.get("push_to_hub")
    where = repo or "path/to/this/dir"
    fingerprint = info.get("fingerprint", "")
    size = output_bytes(info)
    big = bool(repo) or size > BIG_OUTPUT_BYTES
    command = re.sub(r"hf_[A-Za-z0-9]{8,}", "hf_***", command)  # never a token in a card
    stored = {"bfloat16": "int16 bits of bfloat16", "float16": "float16", "float32": "float32",
              "float8_e4m3": "uint8 bits of float8_e4m3fn (x = q * scale)"}.get(dtype, dtype)
    exactness = STORAGE_EXACTNESS.get(dtype, f"stored as {dtype}")
    stream_arg = ", streaming=True" if repo else ""
    view_note = "bfloat16, dequantized" if dtype == "float8_e4m3" else "a view"
    scale_cols = ("\n- `hidden_states_scale`: (T, {n}) float32, one scale per token and layer (fp8: absmax / 448)"
                  .format(n=num_layers) if dtype == "float8_e4m3" else "")
    final_col = (f"\n- `final_hidden_state`: (T, {hidden}) {stored}, the output of the final norm (transformers' "
                 "`hidden_states[N]`, the input of lm_head)") if info["final_hidden"] else ""
    policy = cfg.get("teacher_policy") or 0
    policy_col = (f"\n- `policy_ids` (T, {policy}) int32, `policy_logprobs` (T, {policy}) float16, `policy_tail` (T, 1) "
                  "float32: the target's serving distribution of the next token (--teacher-policy; -inf: left out)"
                  if policy else "")
    flag_col = ("\n- `has_nonfinite`: bool, the row's states hold NaN/Inf (kept with --nonfinite keep)"
                if cfg.get("nonfinite") == "keep" else "")
    first = info["layers"][0] if info["layers"] else None  # (None: a policy-only output, no hidden states)
    split = cfg.get("split", "?")
    more_cols = scale_cols + final_col + policy_col + flag_col
    hsx_load = f'''```python
import hsx
# {"streamed from the Hub" if repo else "memory-mapped in place"}: torch rows, (T, 1, {hidden}) states of layer {first}
{f'rows = hsx.load("{where}", layers=[{first}]{stream_arg})' if first is not None else ""}
ds = hsx.load("{where}"{stream_arg})  # {"a datasets.IterableDataset" if repo else "a datasets.Dataset, no copy"}
```'''
    plain = f'''```python
import torch
from datasets import load_dataset
ds = load_dataset("{where}", split="train", streaming=True).with_format("torch")
row = next(iter(ds))
{_decode_lines(dtype, num_layers, hidden)}  # (T, layers, hidden){", bit-exact" if dtype == "bfloat16" else ""}
```'''
    if big:
        loading = f"""## Loading
This output holds about **{human_bytes(size)}** of states. A plain `load_dataset("{where}")` first copies all of
it into the HF cache; stream it instead, or read it with hsx:

{hsx_load}

With plain `datasets`, streaming (the states are {exactness}):

{plain}
"""
    else:
        loading = f"""## Loading
The states are {exactness}. Local outputs, memory-mapped, no copy:

```python
import hsx
ds = hsx.load("{where}")           # datasets.Dataset over the Arrow files, memory-mapped
rows = hsx.torch_view("{where}")   # rows[i]["hidden_states"]: torch tensor (T, layers, hidden), {view_note}
```

With plain `datasets` (`load_dataset` on a local dir copies it into the cache; `streaming=True` does not):

{plain}
"""
    text = f"""# Hidden states of `{info['model']}`

Extracted with hsx {info['hsx_version']}: layers **{layers}** of {info['num_model_layers']}
(hidden size {hidden}){" and the final-norm output" if info["final_hidden"] else ""}, stored as {dtype};
{c['rows_written']:,} rows, {c['tokens_written']:,} tokens, about {human_bytes(size)} of states.

Layer convention: {info['layer_convention']}.

{loading}
## Columns
- `sample_id`: int64, the row's index in the input dataset (`{cfg.get('dataset', '?')}`, split `{split}`)
- `input_ids`: int32 token ids; `loss_mask`: int8, 1 on each assistant token including its end-of-turn token (unshifted)
- `num_tokens`: int32
{f"- `hidden_states`: (T, {num_layers}·{hidden}) {stored}, layers concatenated in the order above"
   if num_layers else "- no `hidden_states`: a policy-only output (--teacher-policy without --layers)"}{more_cols}

Rows are ordered by length bucket, then `sample_id`. Skipped input rows: {json.dumps(c['skipped'])};
truncated to {info['max_length']} tokens: {c['truncated']}.

Produced by: `{command}`

Job fingerprint: `{fingerprint}` (hsx.json holds the whole job).
"""
    return str(DatasetCard(f"---\n{card_data(info).to_yaml()}\n---\n\n{text}"))
