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


def test_a_plan_says_what_makes_its_output_fit_with_its_numbers(capsys):
    """`hsx plan` said "8.7 TB on disk" and nothing of what makes it fit: the fp8 storage dtype (its bytes), training
    while extracting, node shares in local dirs."""
    from hsx.cli import main

    assert main(["plan", "--shape", "qwen3.6-27b", "--layers", "1", "16", "31", "46", "61", "--tokens",
                 "170000000"]) == 0
    shown = capsys.readouterr().out
    assert "→ 8.7 TB on disk" in shown
    assert "--storage-dtype float8_e4m3: 25,620 bytes per token, 4.4 TB in all (50%" in shown
    assert "--max-pending-gb N" in shown and "hsx.follow(OUT, delete_consumed=True)" in shown
    assert "4.4 TB over 2, 2.2 TB over 4, 1.1 TB over 8 nodes" in shown
    assert main(["plan", "--shape", "qwen3.6-27b", "--layers", "1", "--tokens", "1000", "--storage-dtype",
                 "float8_e4m3"]) == 0
    assert "--storage-dtype float8_e4m3:" not in capsys.readouterr().out  # (it is what the plan stores already)
