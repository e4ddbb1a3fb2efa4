"""`--teacher-policy K`: the target's serving distribution (top-K, then top-p, at a temperature, renormalised, and
the mass it leaves out), checked against a float32 serving sampler written independently, against ModelOpt's
`deployment_policy`, through speculative sampling's acceptance, and end to end against the CausalLM's logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from types import SimpleNamespace

from helpers import assert_one_error_line, hsx_main
from hsx.config import load_config, target_layers
from hsx.errors import HsxError
from hsx.policy import serving_policy

DEMO = Path(__file__).resolve().parents[1] / "recipes" / "demo.yaml"
MODEL = Path(__file__).resolve().parents[1] / "hsx" / "demo" / "tiny-qwen3"
SETTINGS = [(8, 1.0, 1.0), (8, 0.9, 0.7), (20, 0.95, 1.3), (5, 0.5, 0.0), (16, 1e-6, 1.0)]


def served(logits: torch.Tensor, k: int, top_p: float, temperature: float) -> torch.Tensor:
    """The float64 distribution over the whole vocabulary a server samples from: tempered softmax, the top k kept
    and renormalised, then the smallest prefix (most likely first) whose mass reaches top_p, renormalised (vLLM's
    and SGLang's top-k then top-p filter); temperature 0 is greedy."""
    x = logits.double()
    if temperature == 0:
        out = torch.zeros_like(x)
        return out.scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    p = torch.softmax(x / temperature, dim=-1)
    vals, idx = p.sort(dim=-1, descending=True)
    vals = vals[..., :k] / vals[..., :k].sum(-1, keepdim=True)
    mass_before = torch.cat([torch.zeros_like(vals[..., :1]), vals.cumsum(-1)[..., :-1]], -1)
    vals = torch.where(mass_before < top_p, vals, torch.zeros_like(vals))
    vals = vals / vals.sum(-1, keepdim=True)
    return torch.zeros_like(x).scatter_(-1, idx[..., :k], vals)


def modelopt_deployment_policy(logits, top_k: int, top_p: float, temperature: float):
    """NVIDIA Model-Optimizer's definition, as written in examples/speculative_decoding/collect_hidden_states/
    compute_sparse_policy_hf.py (commit 0759402): ids and log-probs, -inf for slots top-p excluded."""
    p = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    top_p_vals, top_ids = p.topk(top_k, dim=-1)
    top_p_vals = top_p_vals / top_p_vals.sum(-1, keepdim=True).clamp_min(1e-9)
    if top_p and top_p < 1.0:
        keep = (top_p_vals.cumsum(-1) - top_p_vals) < top_p
        top_p_vals = top_p_vals * keep
        top_p_vals = top_p_vals / top_p_vals.sum(-1, keepdim=True).clamp_min(1e-9)
    return top_ids, top_p_vals.log()


def logits_batch(seed: int = 0, n: int = 64, vocab: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * torch.linspace(0.5, 6.0, n)[:, None]  # flat to peaked


def dense(ids: torch.Tensor, log_probs: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(ids.shape[0], vocab, dtype=torch.float64).scatter_(-1, ids, log_probs.double().exp())


@pytest.mark.parametrize("k, top_p, temperature", SETTINGS)
def test_the_policy_is_the_served_distribution(k, top_p, temperature):
    logits = logits_batch()
    ids, lp, tail = serving_policy(logits, k, top_p, temperature)
    ref = served(logits, k, top_p, temperature)
    # stored as float16 log-probs: each probability within float16's relative rounding of its log (2^-11 * |lp|)
    got = dense(ids, lp.to(torch.float16), logits.shape[1])
    assert (got - ref).abs().max() <= 2e-3
    assert torch.allclose(dense(ids, lp, logits.shape[1]), ref, atol=1e-5)  # float32 before storage
    assert torch.allclose(got.sum(-1), torch.ones(len(got), dtype=torch.float64), atol=2e-3)
    # tail = 1 - the kept mass under the full tempered distribution
    if temperature > 0:
        full = torch.softmax(logits.double() / temperature, dim=-1)
        ref_tail = 1 - (full * (ref > 0)).sum(-1)
        assert torch.allclose(tail.double(), ref_tail, atol=1e-5)
    assert ((lp == float("-inf")) == (ref.gather(-1, ids) == 0)).all()  # left out: -inf, in ModelOpt's convention


@pytest.mark.parametrize("k, top_p, temperature", SETTINGS)
def test_it_equals_modelopts_definition(k, top_p, temperature):
    logits = logits_batch(seed=1)
    ids, lp, _ = serving_policy(logits, k, top_p, temperature)
    ref_ids, ref_lp = modelopt_deployment_policy(logits, k, top_p, temperature)
    finite = torch.isfinite(ref_lp)
    assert torch.equal(torch.isfinite(lp), finite)
    # (at temperature 0 ModelOpt's left-out slots are ties at probability 0: their ids are arbitrary there)
    assert torch.equal(ids[finite], ref_ids[finite])
    assert torch.allclose(lp[finite], ref_lp[finite], atol=1e-5)


def test_drafting_against_it_gives_the_served_acceptance():
    """Speculative sampling accepts a draft token x ~ d with probability min(1, p(x)/d(x)): its expected
    acceptance is sum_x min(p(x), d(x)). A drafter scored against the stored policy (float16) sees the acceptance
    it gets against the served distribution, for any draft."""
    logits = logits_batch(seed=2)
    k, top_p, temperature = 20, 0.95, 0.8
    ids, lp, _ = serving_policy(logits, k, top_p, temperature)
    stored = dense(ids, lp.to(torch.float16), logits.shape[1])
    ref = served(logits, k, top_p, temperature)
    g = torch.Generator().manual_seed(3)
    for draft_logits in (logits + torch.randn(logits.shape, generator=g), torch.randn(logits.shape, generator=g)):
        draft = torch.softmax(draft_logits.double(), dim=-1)
        acc_stored = torch.minimum(stored, draft).sum(-1)
        acc_served = torch.minimum(ref, draft).sum(-1)
        assert (acc_stored - acc_served).abs().max() <= 2e-3
    # sampling from it: seeded draws land on the served support only, at the served frequencies
    draws = torch.multinomial(stored[:4].float(), 20000, replacement=True, generator=g)
    for row in range(4):
        freq = torch.bincount(draws[row], minlength=logits.shape[1]).double() / draws.shape[1]
        assert (freq[ref[row] == 0] == 0).all() and (freq - ref[row]).abs().max() < 0.02


def test_options_are_checked(tmp_path):
    base = ["plan", "--shape", "tiny", "--layers", "1"]  # (the tiny shape: 512 tokens, no dataset read)
    rc, _, err = hsx_main([*base, "--teacher-policy", "4", "--teacher-top-p", "1.5"])
    assert rc == 2
    assert_one_error_line(rc, err, "teacher_top_p")
    rc, _, err = hsx_main([*base, "--teacher-top-p", "0.9"])
    assert rc == 2
    assert_one_error_line(rc, err, "--teacher-policy")
    # as --topk-logits, once the model's config is read (hsx plan and extract both check it here; exit 1)
    cfg = load_config(None, {"model": "m", "layers": "1", "teacher_policy": 513}, required=())
    with pytest.raises(HsxError, match="--teacher-policy 513 is more than the model's vocabulary"):
        target_layers(cfg, SimpleNamespace(num_hidden_layers=4, hidden_size=64, vocab_size=512))


@pytest.mark.slow
def test_the_policy_runs_the_final_norm_without_storing_it(tmp_path, model4, small_chat_path):
    """--teacher-policy without --final-hidden: every layer and the final norm run (the policy's input), and only
    the policy is stored beside the chosen layer; `hsx plan` counts its bytes (ids, log-probs, tail)."""
    import hsx

    dest = tmp_path / "plan.json"
    argv = ["--model", str(model4.path), "--layers", "1", "--teacher-policy", "4"]
    assert hsx_main(["plan", *argv, "--dataset", str(small_chat_path), "--json", str(dest)])[0] == 0
    planned = json.loads(dest.read_text())
    assert planned["layers_run"] == model4.num_layers and planned["bytes_per_token"] == 64 * 2 + 4 * 6 + 4
    out = tmp_path / "out"
    rc, _, err = hsx_main(["extract", *argv, "--dataset", str(small_chat_path), "--output-dir", str(out),
                           "--compile", "off"])
    assert rc == 0, err
    features = hsx.load(str(out)).features
    assert "final_hidden_state" not in features and features["policy_ids"].feature.length == 4
    row = hsx.torch_view(str(out))[0]
    assert torch.isfinite(row["policy_tail"]).all() and (row["policy_logprobs"][:, 0] <= 0).all()
    assert torch.allclose(row["policy_logprobs"].float().exp().sum(-1), torch.ones(len(row["input_ids"])),
                          atol=5e-3)


@pytest.mark.slow
def test_a_policy_only_job_stores_no_hidden_states(tmp_path, model4, small_chat_path):
    """--teacher-policy without --layers: no hook, no hidden states; the policy equals the one stored beside the
    states by a job that also keeps the final-norm state (the same forward), and the readers take the output."""
    import hsx

    common = ["extract", "--model", str(model4.path), "--dataset", str(small_chat_path), "--compile", "off",
              "--teacher-policy", "4", "--teacher-top-p", "0.8", "--dtype", "float32"]
    only, both = tmp_path / "only", tmp_path / "both"
    rc, _, err = hsx_main([*common, "--output-dir", str(only)])
    assert rc == 0, err
    assert hsx_main([*common, "--output-dir", str(both), "--layers", "0", "--final-hidden"])[0] == 0
    ds = hsx.load(str(only))
    assert set(ds.features) == {"sample_id", "input_ids", "loss_mask", "num_tokens", "policy_ids", "policy_logprobs",
                                "policy_tail"}
    from hsx.load import read_info

    info = read_info(only)
    assert info.layers == [] and not info.final_hidden and info.config.teacher_policy == 4
    a, b = hsx.torch_view(str(only)), hsx.torch_view(str(both))
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["sample_id"] == y["sample_id"] and torch.equal(x["policy_ids"], y["policy_ids"])
        assert torch.equal(x["policy_logprobs"], y["policy_logprobs"])
    batch = hsx.collate([a[0], a[1]])
    assert batch["policy_logprobs"].shape[:2] == batch["input_ids"].shape and "hidden_states" not in batch
    rc, _, err = hsx_main(["verify", str(only)])
    assert rc == 0, err


@pytest.mark.slow
def test_extracted_policy_matches_the_causal_lm(tmp_path):
    import hsx
    from transformers import AutoModelForCausalLM

    k, top_p, temperature = 6, 0.9, 0.7
    out = tmp_path / "policy"
    rc, _, err = hsx_main(["extract", "--config", str(DEMO), "--output-dir", str(out), "--limit", "20",
                           "--teacher-policy", str(k), "--teacher-top-p", str(top_p),
                           "--teacher-temperature", str(temperature), "--dtype", "float32",
                           "--storage-dtype", "float32"])  # (float32: the reference sees the logits hsx saw)
    assert rc == 0, err
    assert hsx.load(str(out)).features["policy_logprobs"].feature.length == k
    view = hsx.torch_view(str(out))
    causal = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    head = causal.lm_head.weight.detach()
    for i in range(0, len(view), 5):
        row = view[i]
        assert row["policy_ids"].dtype == torch.int32 and row["policy_logprobs"].dtype == torch.float16
        got = dense(row["policy_ids"].long(), row["policy_logprobs"], head.shape[0])
        # the served distribution (float64 maths) of the logits of the stored final-norm state, within float16's
        # rounding of the stored log-probs
        logits = row["final_hidden_state"] @ head.t()
        ref = served(logits, k, top_p, temperature)
        assert (got - ref).abs().max() < 2e-3
        tail = row["policy_tail"].reshape(-1).double()
        ref_tail = 1 - (torch.softmax(logits.double() / temperature, dim=-1) * (ref > 0)).sum(-1)
        assert (tail - ref_tail).abs().max() < 1e-5
        # and position t is the distribution of token t + 1: the CausalLM's own logits at t
        with torch.inference_mode():
            full = torch.softmax(causal(input_ids=row["input_ids"].long()[None]).logits[0].double() / temperature, -1)
        assert (got - served(torch.log(full), k, top_p, 1.0)).abs().max() < 2e-3
