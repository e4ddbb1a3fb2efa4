"""`hsx regenerate`: the target's own answers for a dataset's conversations (on-policy data for drafters), written
as a dataset `hsx extract --dataset OUT` and `load_dataset(OUT)` read directly (docs/regenerate.md).

Input rows are read as extract reads them (hsx.inputs; chat rows: messages, conversations, prompt[+completion]),
each conversation normalized as hsx.data normalizes it. For each row and sample the answers are asked of the engine
(hsx.generators: the model in-process, or OpenAI-compatible servers) turn by turn, each conditioned on the answers
regenerated before it (`turns: all`), or only the final one (`last`). An output row holds the messages with the new
answers, and per answer the token ids the engine generated, its finish reason and the sampling that made it
(`generated`, `sampling`), which extract supervises exactly (hsx.masks.generated_supervision); `rows: per-turn`
writes one row per answer instead, ending at it and naming only it in `generated`.

A job like extract's: input rows are cut into units of `unit_size` rows (and all their samples); each unit is
written as one `data/train-UUUUU-of-NNNNN.jsonl` file and then committed by its record in `.hsx/regenerate/` (both
atomic and fsynced), so a killed job loses at most its units in flight and a rerun writes each conversation once.
Ranks (RANK / WORLD_SIZE, as `hsx launch` or torchrun set them) take units in turn. The job's identity (input,
model, engine, sampling) is recorded; a rerun with another is refused. Every (row, sample) is written, skipped with
a reason, or an error with its reason (`.hsx/regenerate/errors.jsonl`): written + skipped + errors == rows × n,
counted in conversations (with `rows: per-turn` a written conversation is one output row per answer, all committed
in the same unit: conversation-atomic).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsx import data, files
from hsx.config import RegenerateConfig, regenerate_config_from
from hsx.errors import HsxError
from hsx.generators import Answer, AnswerError, ModelGenerator, Sampling, ServerPool, drop_reasoning, parse_servers

FORMAT_VERSION = 1  # of the rows written (part of the identity)
SAMPLED_IN_PROCESS = ("hsx regenerate: sampling in-process: transformers' continuous batching draws every request's "
                      "tokens from one generator seeded once with --seed (no per-request seed), so a sampled answer "
                      "depends on which requests share its batches; it is repeatable only by a run with the same "
                      "batches (--concurrency 1, the same input and options, not resumed midway); greedy "
                      "(--temperature 0) does not depend on it, and servers take each request's own seed "
                      "(docs/regenerate.md#engines)")
STATE_DIR = ".hsx"
STATE_FILE = "regenerate.json"  # in STATE_DIR: the job's identity, and its summary once complete
UNITS_DIR = "regenerate"  # in STATE_DIR: one record per committed unit, and errors.jsonl once complete
CHAT_COLUMNS = ("messages", "conversations")
MAX_RECORD_BYTES = 64 << 20  # a state file or unit record (an input of many files; a unit of many errors)


@dataclass
class Outcome:
    """What became of one (row, sample): its rows written (one, or one per answer with `rows: per-turn`), a skip
    reason, or an error (reason, message)."""
    source_row: int
    sample: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: str = ""
    error: tuple[str, str] | None = None
    unreachable: bool = False
    answers: int = 0
    tokens: int = 0


@dataclass
class Progress:
    bar: Any
    started: float = field(default_factory=time.monotonic)
    answers: int = 0
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.answers += outcome.answers
            self.tokens += outcome.tokens
            elapsed = max(time.monotonic() - self.started, 1e-6)
            self.bar.set_postfix_str(f"{self.answers / elapsed:.2f} answers/s, {self.tokens / elapsed:,.0f} tok/s",
                                     refresh=False)
            self.bar.update(1)


class DaemonPool:
    """ThreadPoolExecutor's submit on daemon threads: a job that stops (an error, a second Ctrl-C) exits at once,
    not after its requests in flight have run to their timeouts (the executor's threads are joined at exit)."""

    def __init__(self, workers: int):
        import queue

        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"hsx-regenerate-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001  (handed to whoever waits on the future)
                    future.set_exception(e)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)


# ---- what to ask ------------------------------------------------------------------------------------------------

def input_format(columns: list[str]) -> str:
    """messages, conversations, prompt+completion, prompt+response or prompt (prompts alone, to be answered)."""
    for fmt in (*CHAT_COLUMNS, "prompt+completion", "prompt+response", "prompt"):
        if all(c in columns for c in fmt.split("+")):
            return fmt
    raise HsxError(f"dataset has none of the columns messages, conversations, prompt (it has: {', '.join(columns)}); "
                   "hsx regenerate answers chat rows (text and input_ids rows hold no turns to answer)")


def conversation_of(row: dict[str, Any], fmt: str) -> tuple[list[dict], int, str]:
    """(messages, how many of them are context whose assistant turns are not asked again, skip reason)."""
    system = row.get("system")
    if fmt in CHAT_COLUMNS:
        conv, reason = data.normalize_conversation(row[fmt], system, need_answer=False)
        return conv, 0, reason
    if fmt == "prompt" or row.get(fmt.split("+")[1]) is None:
        prompt = row["prompt"]
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if prompt is None:
            return [], 0, "missing_prompt"
        conv, reason = data.normalize_conversation(head, system, need_answer=False)
        return conv, len(conv), reason
    answer = fmt.split("+")[1]
    conv, reason = data.prompt_completion_conversation(row["prompt"], row[answer], answer, system)
    completion = row[answer]
    return conv, len(conv) - (len(completion) if isinstance(completion, list) else 1), reason


def answer_slots(conv: list[dict], context: int, turns: str) -> list[int]:
    """The positions of the answers to ask for: each assistant message after the context that is no tool call
    (a tool call is kept as it is: the tool's result that follows answers it), and a new one after a conversation
    that ends with a user or tool message; `last`: only the final one."""
    slots = [k for k, m in enumerate(conv) if k >= max(context, 1) and m["role"] == "assistant"
             and not m.get("tool_calls")]
    if conv and conv[-1]["role"] in ("user", "tool"):
        slots.append(len(conv))
    return slots[-1:] if turns == "last" else slots


def answer_message(answer: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    return message


def regenerate_conversation(ask, cfg: RegenerateConfig, sampling: Sampling, conv: list[dict], tools: list | None,
                            context: int, source_row: int, sample: int) -> Outcome:
    """One (row, sample): its answers asked turn by turn, each conditioned on the new ones before it. An answer
    that does not end its turn (cut by max_new_tokens, or a tool call the dataset has no result for) ends the
    conversation there."""
    out = Outcome(source_row, sample)
    slots = answer_slots(conv, context, cfg.turns)
    if not slots:
        out.skipped = "nothing_to_answer"
        return out
    seed = int.from_bytes(hashlib.sha256(f"{cfg.seed}/{source_row}/{sample}".encode()).digest()[:4], "big") >> 1
    new = list(conv)
    records = []
    for j, k in enumerate(slots):
        try:
            answer = ask(new[:k], tools, (seed + j) % (2**31 - 1))
        except AnswerError as e:
            out.error, out.unreachable = (e.reason, str(e)), e.unreachable
            return out
        out.answers += 1
        out.tokens += len(answer.token_ids or ())
        if cfg.reasoning == "drop":
            answer = drop_reasoning(answer)
        if k == len(new):
            new.append(answer_message(answer))
        else:
            new[k] = answer_message(answer)
        records.append({"message": k, "token_ids": answer.token_ids, "token_ids_from": answer.token_ids_from,
                        "finish_reason": answer.finish_reason})
        if answer.finish_reason != "stop":
            if answer.finish_reason == "length" and cfg.cut_answers == "skip":
                out.skipped = "answer_cut"
                return out
            break
    out.rows = output_rows(new, records, cfg.rows, {"source_row": source_row, "sample": sample,
                                                    "sampling": sampling.as_dict()}, tools)
    return out


def output_rows(messages: list[dict], records: list[dict], layout: str, fields: dict[str, Any],
                tools: list | None) -> list[dict[str, Any]]:
    """The rows of one answered conversation: `per-conversation`, one holding every answer (through the last);
    `per-turn`, one per answer, ending at it and naming only it in `generated` (the answers before it are
    context there, so a template that rewrites earlier turns still renders each row's last answer as generated),
    numbered by `turn`."""
    if layout == "per-turn":
        rows = [{"messages": messages[:r["message"] + 1], "generated": [r], "turn": j, **fields}
                for j, r in enumerate(records)]
    else:
        rows = [{"messages": messages[:records[-1]["message"] + 1], "generated": records, **fields}]
    if tools is not None:
        for row in rows:
            row["tools"] = tools
    return rows


REWRITES_EARLIER_REASONING = (
    "hsx regenerate: the chat template drops the reasoning of earlier assistant turns (as Qwen3's does): a row "
    "holding several answers that reason will not render as they were generated, and extract skips it "
    "(generated_tokens_mismatch); --rows per-turn writes one row per answer, each rendering as generated")


def rewrites_earlier_reasoning(tokenizer, template_kwargs: dict[str, Any]) -> bool:
    """Whether the template renders an answer's reasoning (as reasoning_content, or a think block in its content)
    in the last assistant turn but not in an earlier one: then a row of several answers cannot render as generated.
    A template that raises on the probe is not judged here (extract's check still holds)."""
    from hsx.render import render_chat

    marker = "hsx-probe-reasoning"
    forms = ({"content": "Answer.", "reasoning_content": marker},
             {"content": f"<think>\n{marker}\n</think>\n\nAnswer."})
    for form in forms:
        conv = [{"role": "user", "content": "Question?"}, {"role": "assistant", **form},
                {"role": "user", "content": "Another?"}, {"role": "assistant", **form}]
        try:
            text = render_chat(tokenizer, conv, None, False, template_kwargs)
        except Exception:  # noqa: BLE001  (a template that refuses the probe: no verdict)
            continue
        if text.count(marker) == 1 and text.rindex(marker) > text.rindex("Another?"):
            return True
    return False


# ---- the output dir -----------------------------------------------------------------------------------------------

@dataclass
class RegenDir:
    root: Path

    @property
    def state(self) -> Path:
        return self.root / STATE_DIR / STATE_FILE

    @property
    def units(self) -> Path:
        return self.root / STATE_DIR / UNITS_DIR

    @property
    def errors(self) -> Path:
        return self.units / "errors.jsonl"

    def data_file(self, unit: int, count: int) -> Path:
        return self.root / "data" / f"train-{unit:05d}-of-{count:05d}.jsonl"

    def record(self, unit: int) -> Path:
        return self.units / f"unit-{unit:05d}.json"

    def start_or_resume(self, identity: dict[str, Any], overwrite: bool) -> None:
        """Start the job here, or continue it: HsxError in one line for a dir holding anything else, or this job
        under another identity (naming what differs)."""
        if self.root.exists() and not self.root.is_dir():
            raise HsxError(f"--output-dir {self.root} is a file")
        if overwrite:
            self._clear()
        if self.state.exists():
            old = files.read_json(self.state, limit=MAX_RECORD_BYTES)
            if not isinstance(old, dict) or not isinstance(old.get("identity"), dict):
                raise HsxError(f"{self.state} is damaged (not hsx regenerate's record); give another --output-dir "
                               "or --overwrite")
            if old["identity"] != identity:
                keys = sorted(k for k in set(old["identity"]) | set(identity)
                              if old["identity"].get(k) != identity.get(k))
                raise HsxError(f"{self.root} holds another regenerate job (differs in: {', '.join(keys)}); give "
                               "another --output-dir, the same options, or --overwrite")
            return
        if self.root.is_dir() and not self._only_ours():
            raise HsxError(f"--output-dir {self.root} holds files hsx regenerate did not write; give an empty or new "
                           "folder")
        self.units.mkdir(parents=True, exist_ok=True)
        (self.root / "data").mkdir(exist_ok=True)
        files.atomic_write(self.state, json.dumps({"identity": identity, "complete": False}, indent=1) + "\n")

    def _only_ours(self) -> bool:
        """Whether the dir holds nothing but what a job starting here makes before its state file (another rank's
        folders, a kill between them and the state file)."""
        allowed = {STATE_DIR: {UNITS_DIR, STATE_FILE, files.atomic_tmp_name(STATE_FILE)}, "data": set()}
        for entry in self.root.iterdir():
            if entry.name not in allowed or not entry.is_dir() or entry.is_symlink():
                return False
            if any(inner.name not in allowed[entry.name] for inner in entry.iterdir()):
                return False
        units = self.units
        return not units.is_dir() or not any(units.iterdir())

    def _clear(self) -> None:
        """--overwrite: what this job wrote (its data files and records), never anything else."""
        if not self.state.exists():
            return
        for f in sorted((self.root / "data").glob("train-*-of-*.jsonl")):
            f.unlink()
        shutil.rmtree(self.units, ignore_errors=True)
        self.state.unlink()
        for d in (self.root / "data", self.root / STATE_DIR):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()

    def done(self) -> dict[int, dict[str, Any]]:
        """The committed units' records (a damaged one is not committed: its unit is written again)."""
        records = {}
        for f in sorted(self.units.glob("unit-*.json")):
            try:
                record = files.read_json(f, limit=MAX_RECORD_BYTES)
            except HsxError:
                continue
            if _well_formed(record) and f.name == self.record(record["unit"]).name:
                records[record["unit"]] = record
        return records

    def commit(self, unit: int, count: int, outcomes: list[Outcome]) -> dict[str, Any]:
        """The unit's rows into its data file, then its record (the commit), both atomic and fsynced."""
        rows = [r for o in outcomes for r in o.rows]
        path = self.data_file(unit, count)
        if rows:
            files.atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        elif path.exists():  # (a kill between an earlier attempt's data file and its record)
            path.unlink()
        skipped: dict[str, int] = {}
        for o in outcomes:
            if o.skipped:
                skipped[o.skipped] = skipped.get(o.skipped, 0) + 1
        record = {"unit": unit, "file": path.name if rows else None, "written": sum(bool(o.rows) for o in outcomes),
                  "rows": len(rows),
                  "skipped": dict(sorted(skipped.items())),
                  "errors": [{"source_row": o.source_row, "sample": o.sample, "reason": o.error[0],
                              "message": o.error[1]} for o in outcomes if o.error],
                  "answers": sum(o.answers for o in outcomes), "tokens": sum(o.tokens for o in outcomes)}
        files.atomic_write(self.record(unit), json.dumps(record) + "\n")
        return record


def _well_formed(record: dict[str, Any]) -> bool:
    ints = all(type(record.get(k)) is int and record[k] >= 0
               for k in ("unit", "written", "rows", "answers", "tokens"))
    skipped, errors = record.get("skipped"), record.get("errors")
    return (ints and isinstance(skipped, dict) and all(type(v) is int and v >= 0 for v in skipped.values())
            and isinstance(errors, list) and all(isinstance(e, dict) and isinstance(e.get("reason"), str)
                                                 for e in errors))


# ---- the job ----------------------------------------------------------------------------------------------------

def identity(cfg: RegenerateConfig, ds, sampling: Sampling) -> dict[str, Any]:
    """What makes two runs the same job: input, model, engine, sampling, what is asked and kept, the unit plan."""
    from hsx import inputs
    from hsx.fingerprint import model_identity, tokenizer_identity

    return {"input": inputs.input_fingerprint(cfg, ds), "limit": cfg.limit, "rows": len(ds),
            "model": model_identity(cfg.model, cfg.model, cfg.trust_remote_code),
            "tokenizer": tokenizer_identity(cfg.tokenizer, cfg.trust_remote_code),
            "engine": "openai" if cfg.servers else "transformers",
            "served_model_name": (cfg.served_model_name or cfg.model) if cfg.servers else None,
            "dtype": None if cfg.servers else cfg.dtype, "sampling": sampling.as_dict(), "n": cfg.n,
            "turns": cfg.turns, "output_rows": cfg.rows, "reasoning": cfg.reasoning, "cut_answers": cfg.cut_answers,
            "chat_template_kwargs": cfg.chat_template_kwargs, "unit_size": cfg.unit_size,
            "format_version": FORMAT_VERSION}


def _engine(cfg: RegenerateConfig, tokenizer, sampling: Sampling, log):
    """(ask, close, threads) of the engine `cfg` names."""
    if cfg.servers:
        servers = parse_servers(cfg.servers)
        pool = ServerPool(servers, cfg.served_model_name or cfg.model, tokenizer, sampling, cfg.chat_template_kwargs,
                          cfg.concurrency, cfg.timeout, cfg.retries, len(tokenizer))
        return pool.ask, pool.close, cfg.concurrency * len(servers)
    import torch
    from transformers import AutoModelForCausalLM

    from hsx.run import env_int

    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{env_int('LOCAL_RANK', 0)}" if cuda else "cpu")
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32}.get(cfg.dtype) or getattr(torch, cfg.dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype,
                                                     trust_remote_code=cfg.trust_remote_code).to(device).eval()
    except OSError as e:
        raise HsxError(f"cannot load model {cfg.model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    engine = ModelGenerator(model, tokenizer, sampling, cfg.chat_template_kwargs, cfg.concurrency)
    if sampling.temperature > 0:
        log(SAMPLED_IN_PROCESS)
    return engine.ask, engine.close, cfg.concurrency


def _tokenizer(cfg: RegenerateConfig):
    from transformers import AutoTokenizer

    name = cfg.tokenizer or cfg.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise HsxError(f"cannot load the tokenizer of {name}: {str(e).splitlines()[0] if str(e) else e}") from None
    if not data.chat_template_text(tokenizer):
        raise HsxError(f"tokenizer {name} has no chat template: hsx regenerate asks for chat answers")
    return tokenizer


def regenerate(cfg: RegenerateConfig, log=print) -> dict[str, Any]:
    """Run (or continue) the job; returns its summary (`complete` once every rank's units are committed)."""
    from hsx import inputs
    from hsx.run import env_int, stop_on_signal

    cfg = regenerate_config_from(cfg.to_dict())
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1, low=1)
    if rank >= world:
        raise HsxError(f"RANK={rank} is not below WORLD_SIZE={world}")
    if cfg.overwrite and world > 1:  # (each rank would delete what the others had begun writing)
        raise HsxError("--overwrite with several processes: run it in one process, or give a new --output-dir")
    sampling = Sampling(cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.seed)
    ds = inputs.load_input(cfg)
    fmt = input_format(ds.column_names)
    tokenizer = _tokenizer(cfg)
    if (cfg.rows == "per-conversation" and cfg.turns == "all" and cfg.reasoning == "keep"
            and rewrites_earlier_reasoning(tokenizer, cfg.chat_template_kwargs)):
        log(REWRITES_EARLIER_REASONING)
    out = RegenDir(Path(cfg.output_dir))
    out.start_or_resume(identity(cfg, ds, sampling), cfg.overwrite)
    count = -(-len(ds) // cfg.unit_size)
    done = out.done()
    mine = [u for u in range(count) if u % world == rank and u not in done]
    if mine:
        _run_units(cfg, ds, fmt, tokenizer, sampling, out, mine, count, rank, log, stop_on_signal)
    return _finish(cfg, out, len(ds), count, log)


def _run_units(cfg, ds, fmt, tokenizer, sampling, out: RegenDir, mine: list[int], count: int, rank: int, log,
               stop_on_signal) -> None:
    from tqdm.auto import tqdm

    ask, close, threads = _engine(cfg, tokenizer, sampling, log)
    total = sum(min(cfg.unit_size, len(ds) - u * cfg.unit_size) for u in mine) * cfg.n
    bar = tqdm(total=total, unit="conv", desc="regenerating" if rank == 0 else f"regenerating (rank {rank})",
               dynamic_ncols=True)
    progress = Progress(bar)
    pool = DaemonPool(threads)
    pending: deque[tuple[int, list[Future]]] = deque()
    try:
        with stop_on_signal(log) as stop:
            queue = list(mine)
            unit = mine[0]
            while queue or pending:
                # two units in flight: the next one's conversations keep the engine busy while one is committed
                while queue and len(pending) < 2 and not stop.is_set():
                    unit = queue.pop(0)
                    pending.append((unit, _submit(pool, cfg, ds, fmt, unit, ask, sampling, progress)))
                if not pending:
                    break
                unit, futures = pending.popleft()
                outcomes = [f.result() for f in futures]
                lost = next((o for o in outcomes if o.unreachable), None)
                if lost is not None:  # a server gone, not an answer wrong: never recorded as the row's error
                    raise HsxError(f"no server answered row {lost.source_row} (sample {lost.sample}): "
                                   f"{lost.error[1]}; unit {unit} was not committed: rerun the same command once a "
                                   "server answers")
                out.commit(unit, count, outcomes)
            if stop.is_set() and queue:
                raise stop.stopped(f"stopped after committing unit {unit} ({len(queue)} of this rank's units "
                                   "left): rerun the same command to continue")
    finally:
        bar.close()
        for _, futures in pending:  # (units given up: their conversations not started are not asked)
            for f in futures:
                f.cancel()
        pool.shutdown()
        close()


def _submit(pool, cfg, ds, fmt, unit: int, ask, sampling: Sampling, progress: Progress) -> list[Future]:
    start = unit * cfg.unit_size
    rows = ds.select(range(start, min(start + cfg.unit_size, len(ds)))).to_list()
    futures = []
    for offset, row in enumerate(rows):
        conv, context, reason = conversation_of(row, fmt)
        tools = data.row_tools(row["tools"]) if "tools" in row else None
        for sample in range(cfg.n):
            if reason:
                f: Future = Future()
                f.set_result(Outcome(start + offset, sample, skipped=reason))
                progress.add(f.result())
            else:
                f = pool.submit(regenerate_conversation, ask, cfg, sampling, conv, tools, context, start + offset,
                                sample)
                f.add_done_callback(lambda done: progress.add(done.result())
                                    if not done.cancelled() and done.exception() is None else None)
            futures.append(f)
    return futures


def _finish(cfg: RegenerateConfig, out: RegenDir, rows: int, count: int, log) -> dict[str, Any]:
    """The summary of the units committed so far; once all are, written to the state file with the errors."""
    done = out.done()
    written = sum(r["written"] for r in done.values())
    rows_written = sum(r["rows"] for r in done.values())
    skipped: dict[str, int] = {}
    for r in done.values():
        for k, v in r["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    errors = [e for u in sorted(done) for e in done[u]["errors"]]
    reasons: dict[str, int] = {}
    for e in errors:
        reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
    complete = len(done) == count
    summary = {"complete": complete, "conversations": rows * cfg.n if complete else None, "written": written,
               "rows_written": rows_written,
               "skipped": dict(sorted(skipped.items())), "errors": dict(sorted(reasons.items())),
               "answers": sum(r["answers"] for r in done.values()), "tokens": sum(r["tokens"] for r in done.values())}
    if complete:
        if written + sum(skipped.values()) + len(errors) != rows * cfg.n:
            raise HsxError(f"{out.root}: its unit records account for {written + sum(skipped.values()) + len(errors)} "
                           f"conversations, not {rows * cfg.n}; rerun with --overwrite")
        files.atomic_write(out.errors, "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors))
        state = files.read_json(out.state, limit=MAX_RECORD_BYTES)
        files.atomic_write(out.state, json.dumps({**state, **summary}, indent=1) + "\n")
        problems = "".join(f", {v} {k}" for k, v in {**skipped, **reasons}.items())
        split = f" (as {rows_written} rows, one per answer)" if cfg.rows == "per-turn" else ""
        log(f"hsx regenerate: {written} of {rows * cfg.n} conversations written{split} to {out.root}{problems}"
            + (f" (errors: {out.errors})" if errors else ""))
    else:
        log(f"hsx regenerate: this rank's units are committed ({len(done)} of {count} in all); the others' ranks "
            "finish the job")
    return summary
