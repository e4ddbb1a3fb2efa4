"""`hsx regenerate`: the target's own answers, in-process (transformers' continuous batching, the embedded demo
model) and from OpenAI-compatible servers (a fake one on loopback, well behaved and hostile), written so that
`hsx extract` over the output supervises exactly the token ids the engine generated; a job that accounts for every
conversation once across kills, signals, ranks and resumes."""

from __future__ import annotations

import glob
import json
import random
import signal
from pathlib import Path

import pytest
from fake_openai import HOSTILE, FakeServer
from helpers import REPO, hsx_child, hsx_main, write_jsonl

import hsx
from hsx.errors import HsxError

DEMO = REPO / "hsx" / "demo" / "tiny-qwen3"
CHAT = REPO / "hsx" / "demo" / "chat.jsonl"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO)


def written_rows(out: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(glob.glob(str(out / "data" / "*.jsonl"))) for line in open(f)]


def state(out: Path) -> dict:
    return json.loads((out / ".hsx" / "regenerate.json").read_text())


def extract_masks_are_generated(out: Path, tmp: Path, **extract_options) -> int:
    """`hsx.extract` over a regenerated dir: each row's supervised tokens are exactly the ids the engine generated
    (its answers' token_ids, in order; an answer the server gave no ids for is its text's tokens and the end of
    turn that stopped it). Returns the rows extracted."""
    rows = written_rows(out)
    ds = hsx.extract(model=str(DEMO), dataset=str(out), layers=[1], output_dir=str(tmp / "extracted"),
                     **extract_options)
    assert len(ds) == len(rows)
    eot = [2]  # the demo template's <|im_end|>
    for r in ds:
        src = rows[r["sample_id"]]
        supervised = [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]
        generated = [t for g in src["generated"]
                     for t in g["token_ids"] + (eot if g["token_ids_from"] == "tokenized"
                                                and g["finish_reason"] == "stop" else [])]
        assert supervised == generated, (r["sample_id"], supervised, generated)
    return len(ds)


def chats(n: int = 8) -> list[dict]:
    rows = [json.loads(line) for line in open(CHAT)][:n]
    return rows


# ---- in-process ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_in_process_greedy_is_deterministic_and_extract_supervises_exactly_the_generated_ids(tmp_path):
    """The default engine (the demo model on transformers' continuous batching, on CPU): every conversation of
    several turns gets its answers turn by turn; greedy twice gives the same answers; extract's masks over the
    output are exactly the generated ids (the template reproduces them, checked per turn)."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(4))
    common = dict(model=str(DEMO), dataset=str(data), max_new_tokens=16, unit_size=3, concurrency=4)
    first = hsx.regenerate(output_dir=str(tmp_path / "a"), **common)
    second = hsx.regenerate(output_dir=str(tmp_path / "b"), **common)
    assert first["complete"] and first["written"] == 4
    a, b = written_rows(tmp_path / "a"), written_rows(tmp_path / "b")
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["generated"] for r in a] == [r["generated"] for r in b]
    turns = [len(r["generated"]) for r in a]
    assert max(turns) >= 2  # multi-turn conversations answered turn by turn
    assert all(g["token_ids_from"] == "engine" for r in a for g in r["generated"])
    assert extract_masks_are_generated(tmp_path / "a", tmp_path) == 4


# ---- servers: well behaved -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_in_process_sampling_says_once_what_is_reproducible_and_repeats_with_the_same_batches(tmp_path):
    """transformers' continuous batching takes no per-request seed: a sampled in-process run says so once in the
    log, and two runs with the same batches (--concurrency 1, same input and options) give the same answers."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(2))
    from hsx.config import load_regenerate_config
    from hsx.regeneration import SAMPLED_IN_PROCESS
    from hsx.regeneration import regenerate as run_regenerate

    answers, logs = [], []
    for name in ("a", "b"):
        cfg = load_regenerate_config(None, dict(model=str(DEMO), dataset=str(data), output_dir=str(tmp_path / name),
                                                max_new_tokens=6, concurrency=1, temperature=0.9, seed=5))
        run_regenerate(cfg, log=logs.append)
        answers.append([r["generated"] for r in written_rows(tmp_path / name)])
    assert logs.count(SAMPLED_IN_PROCESS) == 2 and "per-request seed" in SAMPLED_IN_PROCESS  # once per run
    assert answers[0] == answers[1] and len(answers[0]) == 2


def run_against(server_urls: list[str], data: Path, out: Path, **options):
    return hsx.regenerate(model=str(DEMO), dataset=str(data), output_dir=str(out), servers=",".join(server_urls),
                          **{"concurrency": 4, "unit_size": 3, "timeout": 5.0, **options})


def test_server_answers_turn_by_turn_with_their_ids_and_extract_masks_are_exact(tokenizer, tmp_path):
    """Two well-behaved servers: each assistant turn asked with the regenerated turns before it, n samples per
    conversation (each its own seed), the server's token ids stored, the sampling recorded; extract over the output
    supervises exactly those ids."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(7))
    with FakeServer(tokenizer) as s1, FakeServer(tokenizer) as s2:
        summary = run_against([s1.url, s2.url], data, tmp_path / "out", n=2, temperature=0.7, top_k=5, seed=3)
        requests = s1.requests + s2.requests
    assert summary["complete"] and summary["written"] == 14 and summary["errors"] == {}
    assert s1.requests and s2.requests  # both servers used
    rows = written_rows(tmp_path / "out")
    assert sorted((r["source_row"], r["sample"]) for r in rows) == [(i, s) for i in range(7) for s in range(2)]
    src = chats(7)
    for r in rows:
        original = src[r["source_row"]]["messages"]
        assert [m["role"] for m in r["messages"]] == [m["role"] for m in original]
        assert r["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 5, "max_new_tokens": 2048, "seed": 3}
        for g in r["generated"]:
            assert g["token_ids_from"] == "engine" and g["finish_reason"] == "stop"
            assert tokenizer.decode(g["token_ids"][:-1]) == r["messages"][g["message"]]["content"]
    # turn by turn: a later turn's request carries the regenerated answer of the earlier turn, not the dataset's
    multi = next(r for r in rows if len(r["generated"]) >= 2)
    k = multi["generated"][1]["message"]
    assert any(q["messages"] == multi["messages"][:k] for q in requests)
    assert all(q["top_k"] == 5 and q["temperature"] == 0.7 and q["return_token_ids"] for q in requests)
    # two samples of one conversation were asked with different seeds
    assert len({q["seed"] for q in requests}) > 7
    assert extract_masks_are_generated(tmp_path / "out", tmp_path) == 14


def test_last_turn_only_keeps_earlier_turns_as_context(tokenizer, tmp_path):
    """turns=last: only the final answer is asked; extract supervises only it (the dataset's earlier answers are
    context, not the target's)."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(5))
    with FakeServer(tokenizer) as s:
        summary = run_against([s.url], data, tmp_path / "out", turns="last")
    assert summary["written"] == 5
    src = chats(5)
    for r in written_rows(tmp_path / "out"):
        assert len(r["generated"]) == 1 and r["generated"][0]["message"] == len(r["messages"]) - 1
        assert r["messages"][:-1] == src[r["source_row"]]["messages"][:-1] or \
            r["messages"][0]["role"] == "system"
    extract_masks_are_generated(tmp_path / "out", tmp_path)


def per_conversation_rows(rows: list[dict]) -> dict[tuple[int, int], list[dict]]:
    by: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by.setdefault((r["source_row"], r["sample"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["turn"]) for k, v in by.items()}


def test_per_turn_rows_each_end_at_their_answer_and_extract_supervises_only_it(tokenizer, tmp_path):
    """rows=per-turn: a conversation of k regenerated answers is k rows, the j-th ending at its answer (the answers
    before it the regenerated ones, as it was asked), naming only it in `generated`; extract supervises each row on
    exactly its last answer's generated ids. The accounting counts conversations: written + skipped + errors ==
    rows × n, and rows_written the rows."""
    src = chats(6) + [{"messages": [{"role": "assistant", "content": "no user turn"}]}]
    data = write_jsonl(tmp_path / "in.jsonl", src)
    with FakeServer(tokenizer) as s:
        summary = run_against([s.url], data, tmp_path / "out", n=2, rows="per-turn")
    rows = written_rows(tmp_path / "out")
    convs = per_conversation_rows(rows)
    answers = {k: sum(m["role"] == "assistant" for m in src[k[0]]["messages"]) for k in convs}
    assert summary["complete"] and summary["written"] == 12 and summary["skipped"] == {"nothing_to_answer": 2}
    assert summary["written"] + sum(summary["skipped"].values()) + len(summary["errors"]) == 7 * 2
    assert summary["rows_written"] == len(rows) == sum(answers.values()) > 12
    for key, turns in convs.items():
        assert [r["turn"] for r in turns] == list(range(answers[key]))
        last = turns[-1]["messages"]
        for r in turns:
            (g,) = r["generated"]
            assert g["message"] == len(r["messages"]) - 1
            assert r["messages"] == last[:len(r["messages"])]  # earlier answers: the regenerated ones
    assert extract_masks_are_generated(tmp_path / "out", tmp_path) == len(rows)


def test_per_turn_rows_are_written_once_across_an_uncommitted_unit(tokenizer, tmp_path):
    """A unit whose data file was written but whose record was not (a kill between them) is written again, whole:
    each conversation's rows once, none duplicated; the identity records the row layout."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(7))
    out = tmp_path / "out"
    with FakeServer(tokenizer) as s:
        first = run_against([s.url], data, out, rows="per-turn")
        before = written_rows(out)
        (out / ".hsx" / "regenerate" / "unit-00001.json").unlink()
        again = run_against([s.url], data, out, rows="per-turn")
        with pytest.raises(HsxError, match="differs in: output_rows"):
            run_against([s.url], data, out)
    assert written_rows(out) == before
    assert again["rows_written"] == first["rows_written"] == len(before)
    assert sorted({(r["source_row"], r["turn"]) for r in before}) == sorted((r["source_row"], r["turn"])
                                                                             for r in before)


# A Qwen3-style template: an assistant turn's reasoning (reasoning_content) is rendered only after the last user
# message; earlier turns lose it, so a conversation's earlier answers never render as they were generated.
DROPS_EARLIER_THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\n' -}}{%- generation -%}"
    "{%- if loop.index0 > ns.last_user and message['reasoning_content'] is defined and message['reasoning_content'] -%}"
    "{{- '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' -}}{%- endif -%}"
    "{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}")


def test_a_template_that_drops_earlier_reasoning_is_exact_with_per_turn_rows(tokenizer, tmp_path):
    """A template that rewrites earlier turns (Qwen3's dropped reasoning): a multi-turn row holding every answer
    cannot be reproduced (its earlier answers render without their think blocks), so extract skips it as
    generated_tokens_mismatch and says to use --rows per-turn; with per-turn rows each row's last answer renders as
    generated, and every row is extracted with masks exactly its generated ids."""
    from transformers import AutoTokenizer

    qwen3ish = AutoTokenizer.from_pretrained(DEMO)
    qwen3ish.chat_template = DROPS_EARLIER_THINKING
    qwen3ish.save_pretrained(tmp_path / "tok")
    tok = str(tmp_path / "tok")
    src = chats(6)
    multi = sum(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in src)
    assert multi >= 1
    data = write_jsonl(tmp_path / "in.jsonl", src)
    from hsx.config import load_config, load_regenerate_config
    from hsx.regeneration import REWRITES_EARLIER_REASONING, rewrites_earlier_reasoning
    from hsx.regeneration import regenerate as run_regenerate
    from hsx.run import extract as run_extract

    logs: list[str] = []
    with FakeServer(tokenizer, behaviour="reasoning") as s:
        for name, rows in (("whole", "per-conversation"), ("turns", "per-turn")):
            run_regenerate(load_regenerate_config(None, dict(
                model=str(DEMO), tokenizer=tok, dataset=str(data), output_dir=str(tmp_path / name), servers=s.url,
                rows=rows, concurrency=4, unit_size=3)), log=logs.append)
    assert logs.count(REWRITES_EARLIER_REASONING) == 1  # said before the per-conversation job, not the per-turn one
    assert not rewrites_earlier_reasoning(tokenizer, {})  # the demo template renders every turn as it is
    logs.clear()

    run_extract(load_config(None, dict(model=str(DEMO), tokenizer=tok, dataset=str(tmp_path / "whole"), layers=[1],
                                       output_dir=str(tmp_path / "x-whole"))), log=logs.append)
    info = json.loads((tmp_path / "x-whole" / "hsx.json").read_text())
    assert info["counts"]["skipped"] == {"generated_tokens_mismatch": multi}
    assert any("generated_tokens_mismatch" in line and "--rows per-turn" in line for line in logs)
    rows = written_rows(tmp_path / "turns")
    assert all(r["messages"][-1]["reasoning_content"].startswith("Thinking") for r in rows)
    assert extract_masks_are_generated(tmp_path / "turns", tmp_path, tokenizer=tok) == len(rows) > len(src)


@pytest.mark.parametrize("family, rewrites", [("QWEN3", True), ("QWEN35", True), ("QWEN25", False),
                                              ("SMOLLM3", False)])
def test_the_templates_that_drop_earlier_reasoning_are_told_apart(family, rewrites):
    """The probe behind regenerate's hint to use --rows per-turn: Qwen3 and Qwen3.5 drop earlier turns'
    reasoning; Qwen2.5 (no reasoning) and SmolLM3 (history turns plain, the same for every turn) do not rewrite
    one turn differently from the last."""
    import chat_families as cf

    from hsx.regeneration import rewrites_earlier_reasoning

    tok = cf.family_tokenizer(getattr(cf, family), cf.QWEN_SPECIAL, "<|im_end|>", plain=cf.QWEN_PLAIN)
    assert rewrites_earlier_reasoning(tok, {}) is rewrites


def test_prompts_alone_and_prompt_completion_rows_are_answered(tokenizer, tmp_path):
    """A `prompt` column alone (prompts to answer), string prompt/completion rows, and a conversation that ends
    on a user turn all get a new final answer; a conversation with nothing to answer is skipped and counted."""
    with FakeServer(tokenizer) as s:
        prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Tell me about rivers."}, {"prompt": "Why?"}])
        assert run_against([s.url], prompts, tmp_path / "p")["written"] == 2
        pc = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Hi there", "completion": "old answer"}])
        assert run_against([s.url], pc, tmp_path / "pc")["written"] == 1
        open_end = write_jsonl(tmp_path / "o.jsonl", [
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}]},
            {"messages": [{"role": "system", "content": "only a system prompt"}]}])
        summary = run_against([s.url], open_end, tmp_path / "o")
    assert [len(r["messages"]) for r in written_rows(tmp_path / "p")] == [2, 2]
    row = written_rows(tmp_path / "pc")[0]
    assert row["messages"][1]["content"] != "old answer" and row["generated"][0]["message"] == 1
    assert summary["written"] == 1 and summary["skipped"] == {"nothing_to_answer": 1}
    assert [m["role"] for m in written_rows(tmp_path / "o")[0]["messages"]] == ["user", "assistant", "user",
                                                                                  "assistant"]
    extract_masks_are_generated(tmp_path / "o", tmp_path)


def test_cut_answers_are_flagged_and_their_end_is_not_supervised(tokenizer, tmp_path):
    """An answer cut by max_new_tokens has finish_reason length and ends the conversation; extract supervises its
    generated ids and not the end-of-turn token the template adds after it. cut_answers=skip counts it instead."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(4))
    with FakeServer(tokenizer) as s:
        run_against([s.url], data, tmp_path / "keep", max_new_tokens=3)
        skipped = run_against([s.url], data, tmp_path / "skip", max_new_tokens=3, cut_answers="skip")
    rows = written_rows(tmp_path / "keep")
    assert all(r["generated"][-1]["finish_reason"] == "length" and len(r["generated"]) == 1 for r in rows)
    assert all(len(r["messages"]) == r["generated"][0]["message"] + 1 for r in rows)
    ds = hsx.extract(model=str(DEMO), dataset=str(tmp_path / "keep"), layers=[1], output_dir=str(tmp_path / "x"))
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in ds:
        ids, mask = list(r["input_ids"]), list(r["loss_mask"])
        supervised = [t for t, m in zip(ids, mask) if m]
        assert supervised == rows[r["sample_id"]]["generated"][0]["token_ids"]
        assert eot in ids and eot not in supervised  # rendered after the cut answer, never supervised
    assert skipped["written"] == 0 and skipped["skipped"] == {"answer_cut": 4}


def test_server_without_token_ids_is_tokenized_and_checked(tokenizer, tmp_path):
    """A server that refuses return_token_ids (422, as `transformers serve`): asked again without it, each answer
    tokenized (token_ids_from tokenized) and extract's masks still match them exactly."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(4))
    with FakeServer(tokenizer, behaviour="no_ids") as s:
        summary = run_against([s.url], data, tmp_path / "out")
    assert summary["written"] == 4 and summary["errors"] == {}
    assert {g["token_ids_from"] for r in written_rows(tmp_path / "out") for g in r["generated"]} == {"tokenized"}
    extract_masks_are_generated(tmp_path / "out", tmp_path)


def test_reasoning_kept_or_dropped_and_the_thinking_switch_reaches_the_server(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", chats(2))
    with FakeServer(tokenizer, behaviour="reasoning") as s:
        assert run_against([s.url], data, tmp_path / "keep", enable_thinking=False)["written"] == 2
        assert run_against([s.url], data, tmp_path / "drop", reasoning="drop", turns="last")["written"] == 2
        assert all(q.get("chat_template_kwargs") in ({"enable_thinking": False}, None) for q in s.requests)
        assert any(q.get("chat_template_kwargs") == {"enable_thinking": False} for q in s.requests)
    kept = written_rows(tmp_path / "keep")
    assert all(r["messages"][g["message"]]["reasoning_content"].startswith("Thinking") for r in kept
               for g in r["generated"])
    dropped = written_rows(tmp_path / "drop")
    assert all("reasoning_content" not in r["messages"][-1] or r["messages"][-1]["reasoning_content"] is None
               for r in dropped)
    assert all(g["token_ids"] is None and g["token_ids_from"] == "none" for r in dropped for g in r["generated"])


def test_tool_call_turns_are_kept_as_they_are(tokenizer, tmp_path):
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    conv = [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]
    data = write_jsonl(tmp_path / "in.jsonl", [{"messages": conv}])
    with FakeServer(tokenizer) as s:
        run_against([s.url], data, tmp_path / "out")
    row = written_rows(tmp_path / "out")[0]
    assert row["messages"][1]["tool_calls"][0]["function"]["name"] == "weather"
    assert [g["message"] for g in row["generated"]] == [3]


# ---- servers: hostile ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("behaviour", [b for b in HOSTILE if b not in ("hang", "die", "truncated", "trickle")])
def test_each_hostile_answer_is_a_counted_error_and_the_job_goes_on(tokenizer, tmp_path, behaviour):
    """Alone, a server whose every answer is wrong in one way gives a counted error per conversation (each named
    in the errors file), never a written row; beside a good one, every conversation is written through retries."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(3))
    with FakeServer(tokenizer, behaviour=behaviour) as bad:
        summary = run_against([bad.url], data, tmp_path / "alone", retries=0, max_new_tokens=64)
        with FakeServer(tokenizer) as good:
            mixed = run_against([bad.url, good.url], data, tmp_path / "mixed", retries=3, max_new_tokens=64)
    assert summary["complete"] and summary["written"] == 0 and sum(summary["errors"].values()) == 3, summary
    errors = [json.loads(line) for line in open(tmp_path / "alone" / ".hsx" / "regenerate" / "errors.jsonl")]
    assert sorted(e["source_row"] for e in errors) == [0, 1, 2] and all("\n" not in e["message"] for e in errors)
    assert mixed["written"] == 3 and mixed["errors"] == {}


@pytest.mark.parametrize("behaviour", ["hang", "die", "truncated", "trickle"])
def test_a_server_that_hangs_or_dies_fails_the_unit_uncommitted(tokenizer, tmp_path, behaviour):
    """No server answering (one that hangs, trickles, closes the connection, or cuts its body): the job stops in one
    line and commits nothing of that unit (a server gone is not the row's error), so a rerun against a working
    server writes every conversation."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(2))
    argv = ["regenerate", "--model", str(DEMO), "--dataset", str(data), "--output-dir", str(tmp_path / "out"),
            "--retries", "0", "--timeout", "1.5", "--unit-size", "2"]
    with FakeServer(tokenizer, behaviour=behaviour) as bad:
        rc, _, err = hsx_main([*argv, "--servers", bad.url])
    assert rc == 1 and "no server answered row" in err and "was not committed" in err and "Traceback" not in err
    assert not list((tmp_path / "out" / ".hsx" / "regenerate").glob("unit-*.json"))
    with FakeServer(tokenizer) as good:
        rc, _, err = hsx_main([*argv, "--servers", good.url])
    assert rc == 0, err
    assert len(written_rows(tmp_path / "out")) == 2


# ---- the job ----------------------------------------------------------------------------------------------------

def test_resume_refuses_another_identity_and_a_foreign_dir(tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "in.jsonl", chats(2))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with FakeServer(tokenizer) as s:
        run_against([s.url], data, tmp_path / "out")
        with pytest.raises(HsxError, match="differs in: sampling"):
            run_against([s.url], data, tmp_path / "out", temperature=0.5)
        with pytest.raises(HsxError, match="did not write"):
            run_against([s.url], data, foreign)
        again = run_against([s.url], data, tmp_path / "out", temperature=0.5, overwrite=True)
    assert again["complete"] and (foreign / "notes.txt").read_text() == "mine"
    assert {r["sampling"]["temperature"] for r in written_rows(tmp_path / "out")} == {0.5}


def test_ranks_split_conversations_and_together_write_each_once(tokenizer, tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "in.jsonl", chats(10))
    with FakeServer(tokenizer) as s:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", "1")
        part = run_against([s.url], data, tmp_path / "out")
        assert part["complete"] is False
        monkeypatch.setenv("RANK", "0")
        whole = run_against([s.url], data, tmp_path / "out")
    assert whole["complete"] and whole["written"] == 10
    assert sorted(r["source_row"] for r in written_rows(tmp_path / "out")) == list(range(10))


def test_config_keys_are_typed(tmp_path):
    rc, _, err = hsx_main(["regenerate", "--model", "m", "--dataset", "d", "--output-dir", "o", "--top-p", "0"])
    assert rc == 2 and "top_p" in err
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: m\ndataset: d\noutput_dir: o\nlayers: [1]\n")
    rc, _, err = hsx_main(["regenerate", "--config", str(recipe)])
    assert rc == 2 and "unknown key(s) layers" in err
    with pytest.raises(HsxError, match="n must be an integer"):
        hsx.regenerate(model="m", dataset="d", output_dir="o", n="2")


def test_extract_refuses_a_regenerated_row_whose_ids_the_template_does_not_render(tokenizer, tmp_path):
    """A row whose stored ids are not what its text renders to (edited after regeneration) is skipped by extract
    as generated_tokens_mismatch, never supervised on tokens the engine did not generate."""
    data = write_jsonl(tmp_path / "in.jsonl", chats(3))
    with FakeServer(tokenizer) as s:
        run_against([s.url], data, tmp_path / "out")
    f = sorted((tmp_path / "out" / "data").glob("*.jsonl"))[0]
    rows = [json.loads(line) for line in open(f)]
    rows[0]["generated"][0]["token_ids"] = tokenizer("Not what it said", add_special_tokens=False)["input_ids"]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = hsx.extract(model=str(DEMO), dataset=str(tmp_path / "out"), layers=[1], output_dir=str(tmp_path / "x"))
    info = json.loads((tmp_path / "x" / "hsx.json").read_text())
    assert len(ds) == 2 and "generated_tokens_mismatch" in json.dumps(info)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["per-conversation", "per-turn"])
def test_sigkill_at_seeded_moments_then_resume_writes_every_conversation_once(tokenizer, tmp_path, layout):
    """hsx regenerate killed (SIGKILL) at seeded moments, stopped by SIGTERM once (it finishes the unit and
    exits 143), then run to the end: every (row, sample) exactly once (per turn: each of its answers' rows once),
    and the accounting adds up."""
    from hsx.regeneration import answer_slots, conversation_of

    rows = chats(40)
    data = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out"
    rng = random.Random(7)
    with FakeServer(tokenizer, delay=0.02) as s:
        argv = ["regenerate", "--model", str(DEMO), "--dataset", str(data), "--output-dir", str(out), "--servers",
                s.url, "--unit-size", "4", "--concurrency", "3", "--n", "2", "--rows", layout]
        records = out / ".hsx" / "regenerate"
        for attempt in range(3):
            child = hsx_child(argv, tmp_path / f"logs{attempt}")
            before = len(list(records.glob("unit-*.json"))) if records.exists() else 0
            child.poll_until(lambda: records.exists() and len(list(records.glob("unit-*.json"))) > before,
                             timeout=120)
            if attempt == 1:
                child.signal(signal.SIGTERM)
                assert child.wait() == 143, child.stderr
            else:
                import time

                time.sleep(rng.uniform(0.0, 0.5))
                child.kill_tree(signal.SIGKILL)
                child.wait()
        rc, _, err = hsx_main(argv)
    assert rc == 0, err
    got = sorted((r["source_row"], r["sample"], r.get("turn", 0)) for r in written_rows(out))
    answers = [len(answer_slots(*conversation_of(r, "messages")[:2], "all")) if layout == "per-turn" else 1
               for r in rows]
    assert got == [(i, s, j) for i in range(40) for s in range(2) for j in range(answers[i])]
    summary = state(out)
    assert summary["complete"] and summary["written"] == 80 and summary["conversations"] == 80
    assert summary["rows_written"] == 2 * sum(answers) and (layout == "per-conversation" or sum(answers) > 40)


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes" / "regenerate").glob("*.yaml")), ids=lambda r: r.stem)
def test_regenerate_recipes_parse_and_open_with_their_command(recipe):
    from hsx.config import load_regenerate_config

    first = recipe.read_text().splitlines()[0]
    assert first.startswith(f"# hsx regenerate --config recipes/regenerate/{recipe.name} ")
    cfg = load_regenerate_config(str(recipe), {"output_dir": "out/x", "dataset": "d.jsonl"})
    assert cfg.model


def test_a_server_that_dies_mid_job_leaves_the_others_to_finish(tokenizer, tmp_path):
    """Of two servers, one shuts down (its port closed) after a few answers: its requests in flight and after are
    asked of the other, and every conversation is written once."""
    import threading
    import time

    data = write_jsonl(tmp_path / "in.jsonl", chats(24))
    with FakeServer(tokenizer, delay=0.01) as survivor:
        doomed = FakeServer(tokenizer, delay=0.01).start()

        def kill_after_a_few():
            while len(doomed.requests) < 5:
                time.sleep(0.005)
            doomed.behaviour = "die"  # connections kept alive are cut too, not served on
            doomed.stop()

        killer = threading.Thread(target=kill_after_a_few)
        killer.start()
        summary = run_against([doomed.url, survivor.url], data, tmp_path / "out", retries=4)
        killer.join()
    assert summary["written"] == 24 and summary["errors"] == {}
    assert sorted(r["source_row"] for r in written_rows(tmp_path / "out")) == list(range(24))


def _serving_path() -> str | None:
    """Where `transformers serve`'s FastAPI and Uvicorn are: this environment, or HSX_TEST_SERVING_PATH (a folder
    `pip install --target` filled, kept off the test process's own path); None if neither has them."""
    import importlib.util
    import os

    if importlib.util.find_spec("fastapi") and importlib.util.find_spec("uvicorn"):
        return ""
    extra = os.environ.get("HSX_TEST_SERVING_PATH", "")
    return extra if extra and (Path(extra) / "fastapi").is_dir() and (Path(extra) / "uvicorn").is_dir() else None


@pytest.mark.slow
def test_a_real_transformers_serve_killed_mid_job_then_restarted(tmp_path):
    """A real `transformers serve` (the demo model, continuous batching, CPU, loopback), started by the test, not by
    hsx, SIGKILLed once hsx has committed a unit: hsx stops in one line (or has finished), and after the server is
    back the same command writes every conversation exactly once; extract's masks cover exactly the answers' tokens
    and the end of turn that stopped them (the server gives no token ids: they are tokenized)."""
    import os
    import time
    import urllib.request

    from helpers import Child, child_env, free_port

    serving = _serving_path()
    if serving is None:
        pytest.skip("transformers[serving] (fastapi, uvicorn) is not installed (or set HSX_TEST_SERVING_PATH)")
    port = free_port()
    env = child_env(**({"PYTHONPATH": os.pathsep.join([child_env()["PYTHONPATH"], serving])} if serving else {}))

    def start(logs: str) -> Child:
        import sys

        server = Child([sys.executable, "-m", "transformers.cli.transformers", "serve", "--port", str(port),
                        "--device", "cpu", "--continuous-batching", "--cb-num-blocks", "128", "--cb-block-size",
                        "64", str(DEMO)], tmp_path / logs, env=env)
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                return server
            except OSError:
                assert server.proc.poll() is None, server.stderr[-2000:]
                time.sleep(0.2)
        raise AssertionError("transformers serve did not come up")

    data = write_jsonl(tmp_path / "in.jsonl", chats(16))
    out = tmp_path / "out"
    argv = ["regenerate", "--model", str(DEMO), "--dataset", str(data), "--output-dir", str(out), "--servers",
            f"http://127.0.0.1:{port}/v1", "--unit-size", "2", "--concurrency", "2", "--max-new-tokens", "24",
            "--retries", "1", "--timeout", "30"]
    server = start("serve1")
    try:
        job = hsx_child(argv, tmp_path / "job1")
        records = out / ".hsx" / "regenerate"
        job.poll_until(lambda: records.exists() and any(records.glob("unit-*.json")), timeout=180)
        server.kill_tree(signal.SIGKILL)
        server.wait()
        rc = job.wait(240)
        assert rc == 0 or "no server answered" in job.stderr, job.stderr[-2000:]
        server = start("serve2")
        rc, _, err = hsx_main(argv)
        assert rc == 0, err
    finally:
        server.kill_tree(signal.SIGKILL)
        server.wait()
    got = sorted(r["source_row"] for r in written_rows(out))
    assert got == list(range(16)) and state(out)["complete"]
    assert {g["token_ids_from"] for r in written_rows(out) for g in r["generated"]} == {"tokenized"}
    extract_masks_are_generated(out, tmp_path)


def test_sharegpt_parquet_rows_are_read_as_extract_reads_them(tokenizer, tmp_path):
    """Input formats as docs/inputs.md lists them (here ShareGPT `conversations` in Parquet, a `system` column):
    written back as OpenAI `messages`, the system prompt first; an unusable row skipped with extract's reason."""
    import datasets

    rows = [{"conversations": [{"from": "human", "value": "Hello there"}, {"from": "gpt", "value": "old"}],
             "system": "Be brief."},
            {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "old"}], "system": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "in.parquet"))
    with FakeServer(tokenizer) as s:
        summary = run_against([s.url], tmp_path / "in.parquet", tmp_path / "out")
    assert summary["written"] == 1 and summary["skipped"] == {"null_content": 1}
    row = written_rows(tmp_path / "out")[0]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert row["messages"][0]["content"] == "Be brief." and row["messages"][2]["content"] != "old"
    extract_masks_are_generated(tmp_path / "out", tmp_path)
