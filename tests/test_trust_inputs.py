"""What is read as input (recipes, flags, data, templates, model folders) bounds the work it can cause, and every
problem it causes is one line: integer keys with largest values, an empty input, an offline miss, the file-digest
cache that may save time but never decide, templates that render without bound, and template-kwargs hsx owns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import assert_one_error_line, fault_argv, hsx_main, write_jsonl
from hsx import data
from hsx.config import ExtractConfig, HsxError, config_from, parse_value


# ---- integer keys have largest values --------------------------------------------------------------------------

@pytest.mark.parametrize("name, value", [("max_length", 99999999999999999999), ("token_budget", 99999999999999),
                                         ("unit_tokens", 2**40), ("limit", 10**30), ("topk_logits", 2**31),
                                         ("num_proc", 10**25), ("gpus_per_copy", 10**19)])
def test_an_integer_key_too_large_for_any_machine_is_one_line(name, value):
    with pytest.raises(HsxError, match=f"{name} must be at most"):
        parse_value(name, value)


def test_a_huge_max_length_in_a_recipe_is_one_usage_line(tmp_path, model4, small_chat_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("max_length: 99999999999999999999\n")
    rc, _, err = hsx_main(["extract", "--config", str(recipe), *fault_argv(model4.path, small_chat_path,
                                                                           tmp_path / "out")[1:]])
    assert rc == 2
    assert_one_error_line(rc, err, "max_length must be at most 2,147,483,647")


def test_a_token_budget_no_memory_holds_is_one_line(tmp_path, model4, small_chat_path):
    argv = fault_argv(model4.path, small_chat_path, tmp_path / "out")
    argv[argv.index("--token-budget") + 1] = "2000000000"
    rc, _, err = hsx_main(argv)
    assert_one_error_line(rc, err, "--token-budget 2,000,000,000", "GiB", "memory")


def test_num_proc_is_capped_at_the_cores_this_process_may_use():
    cores = data.cpu_count()
    assert data.tokenize_processes(100000, 10) == cores
    assert data.tokenize_processes(None, 50_000) == min(8, cores)
    assert data.tokenize_processes(None, 10) is None


# ---- empty and missing inputs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["jsonl", "blank-jsonl", "parquet"])
def test_an_empty_input_is_zero_rows_not_a_traceback(tmp_path, model4, kind):
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    else:
        path = tmp_path / "empty.jsonl"
        path.write_text("" if kind == "jsonl" else "\n \n")
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "a"))
    assert rc == 1
    assert_one_error_line(rc, err, "has no rows", "--allow-empty")
    assert "StopIteration" not in err
    rc, _, err = hsx_main(fault_argv(model4.path, path, tmp_path / "b", "--allow-empty"))
    assert rc == 0, err
    import hsx

    assert len(hsx.load(tmp_path / "b")) == 0


def test_a_missing_offline_hub_dataset_says_what_and_where(tmp_path, model4):
    rc, _, err = hsx_main(fault_argv(model4.path, "nobody-hsx/no-such-dataset", tmp_path / "out"))
    line = assert_one_error_line(rc, err, "nobody-hsx/no-such-dataset", "datasets' cache",
                                 os.environ["HF_DATASETS_CACHE"])
    assert "None" not in line
