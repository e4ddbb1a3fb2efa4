"""Top-k target logits: computed in chunks from the final-norm state, equal to the full CausalLM's top-k."""

from pathlib import Path

import numpy as np
import pytest
import torch

import hsx
from hsx.cli import main

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
MODEL = Path(__file__).resolve().parents[1] / "hsx" / "demo" / "tiny-qwen3"


@pytest.mark.slow
def test_topk_logits_match_the_causal_lm(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "topk"
    argv = ["extract", "--config", str(DEMO), "--output-dir", str(out), "--topk-logits", "5", "--limit", "30"]
    assert main(argv) == 0
    ds = hsx.load(str(out)).with_format("arrow")
    assert ds.features["topk_ids"].feature.length == 5
    causal = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    for i in range(0, len(ds), 7):
        row = ds[i]
        ids = torch.tensor(row.column("input_ids")[0].as_py())[None]
        values = torch.from_numpy(row.column("topk_logits").combine_chunks().flatten().flatten().to_numpy().copy())
        top_ids = row.column("topk_ids").combine_chunks().flatten().flatten().to_numpy().reshape(-1, 5)
        with torch.inference_mode():
            logits = causal(input_ids=ids).logits[0].float()
        ref_values, ref_ids = logits.topk(5, dim=-1)
        got = values.view(torch.bfloat16).float().view(-1, 5)
        assert (got - ref_values).abs().max() <= 0.05 * ref_values.abs().max()
        # ids agree wherever the reference's top logits are not (near-)ties: more than 4 bf16 ulps apart (logits
        # near 15 are 0.0625 apart at least; a gap of one ulp flipped with this torch's CPU kernels)
        clear = (ref_values[:, 0] - ref_values[:, 1]) > 2 ** -5 * ref_values[:, 0].abs()
        assert np.array_equal(top_ids[clear.numpy(), 0], ref_ids[clear, 0].numpy())


def test_topk_logits_need_the_final_norm_state(tmp_path, capsys):
    rc = main(["extract", "--model", str(MODEL), "--dataset", str(MODEL.parent / "chat.jsonl"), "--layers", "1",
               "--output-dir", str(tmp_path / "x"), "--topk-logits", "4"])
    assert rc == 2 and "--final-hidden" in capsys.readouterr().err
