"""The automatic token budget: capped at the measured-fastest 16k, limited by memory, never below one row."""

from hsx.cost import DEFAULT_BUDGET_CAP, auto_token_budget, shape_config


def test_budget_is_capped_limited_by_memory_and_holds_a_row():
    c = shape_config("qwen3-8b")
    stored = 5 * 4096
    assert auto_token_budget(c, stored, 100 << 30, 4096) == DEFAULT_BUDGET_CAP
    small = auto_token_budget(c, stored, 2 << 30, 1024)
    assert 1024 <= small < DEFAULT_BUDGET_CAP
    assert auto_token_budget(c, stored, 1 << 20, 4096) == 4096  # never below one full row


def test_eager_attention_scores_shrink_the_budget():
    c = shape_config("qwen3-8b")
    plain = auto_token_budget(c, 5 * 4096, 4 << 30, 4096)
    eager = auto_token_budget(c, 5 * 4096, 4 << 30, 4096, eager_attention=True)
    assert 4096 <= eager < plain
