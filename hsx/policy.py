"""The target's serving distribution as a teacher (`--teacher-policy K`): per token, the next-token distribution a
server samples from, top-k then top-p at a temperature, renormalised, with the probability mass it leaves out.

The definition is NVIDIA ModelOpt's `deployment_policy` (examples/speculative_decoding/collect_hidden_states/
compute_sparse_policy_hf.py): p = softmax(logits / T); the K most likely tokens; their probabilities
renormalised (q); top-p keeps a candidate while the mass of those before it is below P (so the one that crosses
P is kept, as vLLM's and SGLang's samplers do); the kept ones renormalised again. Candidates top-p leaves out keep
their slot with log-probability -inf, so every token's row is K wide, sorted most likely first, and the kept
ones' probabilities sum to 1 (ModelOpt's `sparse_data` reads -inf as 0). `tail` = 1 - the kept candidates' mass
under the full tempered distribution: what drafting from this policy instead of the full one gives up (the
total-variation distance between them).

Worked in float32 from the logits as the server has them (lm_head in the model's dtype), on the device, in chunks
of tokens: no Python per token, no host copy. Position t holds the distribution of token t + 1 (as `topk_logits`);
ModelOpt's record stores it at t + 1.
"""

from __future__ import annotations

import torch

MIN_TEMPERATURE = 1e-6  # ModelOpt's floor: T = 0 (greedy) keeps the most likely token only


def serving_policy(logits: torch.Tensor, k: int, top_p: float = 1.0, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (n, k) int64, log-probs (n, k) float32 with -inf for left-out candidates, tail (n,) float32) of
    logits (n, vocab)."""
    z = logits.float() / max(float(temperature), MIN_TEMPERATURE)
    log_norm = torch.logsumexp(z, dim=-1, keepdim=True)
    top, ids = z.topk(k, dim=-1)  # sorted, most likely first
    if top_p < 1.0:
        q = torch.softmax(top, dim=-1)  # renormalised over the top k, as the serving filter does before top-p
        keep = (q.cumsum(-1) - q) < top_p
        top = top.masked_fill(~keep, float("-inf"))
    kept = torch.logsumexp(top, dim=-1, keepdim=True)
    log_probs = top - kept
    tail = -torch.expm1(kept - log_norm).squeeze(-1)  # 1 - kept mass, exact near 0
    return ids, log_probs, tail.clamp_(0.0, 1.0)
