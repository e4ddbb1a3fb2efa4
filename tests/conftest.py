"""Pytest's hooks and the session fixtures: tiny random models and small datasets built in-process, once per
session. CPU only, offline. The helpers they use, and the test files use, are in helpers.py."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading as _threading

# Before anything imports huggingface_hub / datasets / transformers: no network, a private datasets cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "HF_DATASETS_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="hsx-tests-datasets-cache-")
    os.environ["HF_DATASETS_CACHE"] = _cache
    atexit.register(shutil.rmtree, _cache, True)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from helpers import (  # noqa: E402
    REPO,
    ChatData,
    FaultReference,
    TinyModel,
    copy_of,
    fault_argv,
    finished_job,
    hsx_main,
    mixed_chat_rows,
    output_table,
    save_tiny_model,
    write_jsonl,
)

# ---- a deadline per test ---------------------------------------------------------------------------------------
# pytest-timeout's convention (a `timeout(seconds)` marker, the HSX_TEST_TIMEOUT default) without the plugin, which
# an environment may lack; with the plugin installed, it does the job instead. The deadline covers the test's setup
# (module and session fixtures it is the first to need: a tiny model, a shared extraction), call and teardown.
# On Unix only (SIGALRM). Measured on the 2-core box at a load average of 4-7: the slowest test outside `slow`
# takes 8 s (setup and call), the slowest `slow` one 88 s (a notebook).
TEST_TIMEOUT_S = int(os.environ.get("HSX_TEST_TIMEOUT", "300"))
SLOW_TEST_TIMEOUT_S = 3 * TEST_TIMEOUT_S  # @pytest.mark.slow: subprocess fleets, notebooks, torchrun


def _deadline_of(item) -> int:
    marker = item.get_closest_marker("timeout")
    if marker and marker.args:
        return int(marker.args[0])
    return SLOW_TEST_TIMEOUT_S if item.get_closest_marker("slow") else TEST_TIMEOUT_S


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    import faulthandler
    import signal

    seconds = _deadline_of(item)
    if (not hasattr(signal, "SIGALRM") or seconds <= 0 or item.config.pluginmanager.hasplugin("timeout")
            or _threading.current_thread() is not _threading.main_thread()):
        yield
        return

    def expired(signum, frame):
        faulthandler.dump_traceback(all_threads=True)  # where every thread is (a hang in a worker, a lock)
        pytest.fail(f"{item.nodeid} ran over its {seconds} s deadline (HSX_TEST_TIMEOUT, or @pytest.mark.timeout)",
                    pytrace=False)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    # A hang inside one C call never returns to the interpreter to run the handler: a minute later, dump every
    # thread's stack and end the run (a stuck suite is worse than a stopped one).
    faulthandler.dump_traceback_later(seconds + 60, exit=True)
    try:
        yield
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


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
    return save_tiny_model(tmp_path_factory.mktemp("model8"), tokenizer, num_layers=8)


@pytest.fixture(scope="session")
def model4(tmp_path_factory, tokenizer) -> TinyModel:
    """4 decoder layers, hidden 64: the cheap one for CLI runs."""
    return save_tiny_model(tmp_path_factory.mktemp("model4"), tokenizer, num_layers=4, seed=1)


@pytest.fixture(scope="session")
def no_template_tokenizer_dir(tmp_path_factory) -> Path:
    from hsx.demo import build_tokenizer

    root = tmp_path_factory.mktemp("tok-no-template")
    build_tokenizer(chat_template=None).save_pretrained(root)
    return root


# ---- datasets --------------------------------------------------------------------------------------------------

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


# ---- fault injection and multi-process runs (test_faults.py, test_distributed.py): see helpers.py ------------

@pytest.fixture(scope="session")
def fault_dataset(tmp_path_factory) -> Path:
    """The shipped demo chat (99 rows, 3 of them unusable), copied so its modification time is this session's."""
    path = tmp_path_factory.mktemp("fault-data") / "chat.jsonl"
    shutil.copyfile(REPO / "hsx" / "demo" / "chat.jsonl", path)
    return path


@pytest.fixture(scope="session")
def fault_reference(tmp_path_factory, model4, fault_dataset) -> FaultReference:
    """The uninterrupted 1-process run every faulted or multi-process run must equal."""
    out = tmp_path_factory.mktemp("fault-ref") / "out"
    rc, stdout, stderr = hsx_main(fault_argv(model4.path, fault_dataset, out))
    assert rc == 0, stderr
    info = json.loads((out / "hsx.json").read_text())
    assert info["complete"] and info["units"] >= 40, info["units"]  # enough units for kill points to matter
    ref = FaultReference(model=model4, dataset=fault_dataset, out=out, info=info,
                         sample_ids=output_table(out).column("sample_id").to_pylist())
    assert len(ref.sample_ids) == info["counts"]["rows_written"] == 96
    return ref


@pytest.fixture(scope="session")
def finished(tmp_path_factory, model4, small_chat_path) -> Path:
    """A finished job (model4, the small chat, 200-token units: 4 or more), shared by the whole session: read it,
    never change it; a test that damages or resumes an output works on `finished_copy`."""
    out = finished_job(tmp_path_factory, model4, small_chat_path, "finished")
    assert len(list((out / "data").glob("train-*.arrow"))) >= 4
    return out


@pytest.fixture
def finished_copy(finished, tmp_path) -> Path:
    """This test's own copy of `finished` (tmp_path/out); `finished_argv(model4, small_chat_path, finished_copy)`
    runs its job again on it."""
    return copy_of(finished, tmp_path)
