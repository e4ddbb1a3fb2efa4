"""Where `hsx regenerate`'s answers come from: the target in this process on transformers' continuous batching
(`ModelGenerator`, the default: the demo and CI need nothing else), or OpenAI-compatible chat servers (`ServerPool`:
vLLM, SGLang, `transformers serve`), several at once with bounded concurrency each, timeouts, and retries with
backoff on the least loaded other server. Both answer one conversation prefix at a time from many threads
(`ask`), so hsx.regenerate runs conversations turn by turn, each in its own thread, whichever engine answers.

Nothing a server sends is trusted: a body larger than an answer can be, JSON that does not parse or nests too deep,
a choice without a message, a finish reason that is not one, token ids that are not ids of the vocabulary, more of
them than asked for, or ones that do not decode to the text sent with them are each an AnswerError (retried on
another server, then counted by the job), never an answer.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from hsx.errors import HsxError
from hsx.render import render_chat

FINISH_REASONS = ("stop", "length", "tool_calls")
RESPONSE_BASE_BYTES = 1 << 20  # a response's fixed part; each token allows RESPONSE_BYTES_PER_TOKEN more
RESPONSE_BYTES_PER_TOKEN = 256  # (its text, escaped, and its id, with room for a server's extra fields)
THINK_END = "</think>"


@dataclass
class Answer:
    """One generated assistant answer: its text (and reasoning, where the server parsed it out), the token ids the
    engine generated (its stop token included where it reports it; `token_ids_from`: engine, tokenized where the
    server gave none, none where the stored text is not what was generated), and why it ended."""
    content: str | None
    finish_reason: str
    token_ids: list[int] | None
    token_ids_from: str
    reasoning: str | None = None
    tool_calls: list | None = None


class AnswerError(Exception):
    """A request that gave no answer: `reason` a short code (counted), the message one line. `retry`: worth
    asking again (elsewhere); `unreachable`: no server answered at all (the job stops rather than record it)."""

    def __init__(self, reason: str, message: str, retry: bool = True, unreachable: bool = False):
        super().__init__(message)
        self.reason, self.retry, self.unreachable = reason, retry, unreachable


@dataclass(frozen=True)
class Sampling:
    """What every request asks for (recorded with each output row)."""
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "seed": self.seed}


def drop_reasoning(answer: Answer) -> Answer:
    """`answer` without its reasoning (the server's reasoning_content, or the text through `</think>`): the stored
    text is then not what was generated, so its token ids are not kept."""
    content = answer.content
    if answer.reasoning is None and isinstance(content, str) and THINK_END in content:
        content = content[content.rindex(THINK_END) + len(THINK_END):].lstrip("\n")
    return Answer(content, answer.finish_reason, None, "none", None, answer.tool_calls)


# ---- in-process: transformers' continuous batching ----------------------------------------------------------------

class ModelGenerator:
    """The target in this process on transformers' continuous batching (paged attention; `generate_batch`'s
    manager, kept running): `ask` renders the prompt with the chat template (as extract renders it), queues it
    and waits for its answer, so every thread's conversation shares the batches. Greedy is deterministic; a
    sampled answer depends on which others share its batch: transformers' continuous batching takes no per-request
    seed or generator (`ask`'s seed is not used here), it seeds one generator for the whole run."""

    def __init__(self, model, tokenizer, sampling: Sampling, template_kwargs: dict[str, Any], concurrency: int):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.tokenizer, self.sampling, self.template_kwargs = tokenizer, sampling, template_kwargs
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = tokenizer.eos_token_id if eos is None else eos
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if not self.eos:
            raise HsxError("the model's generation_config and tokenizer name no eos token: answers would never stop")
        greedy = sampling.temperature == 0
        config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=not greedy,
                                  temperature=None if greedy else sampling.temperature,
                                  top_p=None if greedy else sampling.top_p,
                                  top_k=None if greedy or not sampling.top_k else sampling.top_k,
                                  eos_token_id=sorted(self.eos), pad_token_id=tokenizer.pad_token_id or 0)
        cb = {"seed": sampling.seed}
        if model.device.type == "cpu":  # (its defaults size the cache from GPU memory)
            page = 64
            cb.update(page_size=page, max_batch_tokens=1024, use_cuda_graph=False,
                      num_blocks=min(512, max(16, concurrency * -(-(sampling.max_new_tokens + 512) // page))))
        self._context = model.continuous_batching_context_manager(
            generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**cb), warmup=False,
            block=True, timeout=10)
        self.manager = self._context.__enter__()
        self._waiting: dict[str, tuple[threading.Event, list]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._deliver, name="hsx-regenerate-results", daemon=True)
        self._reader.start()

    def _deliver(self) -> None:
        while not self._closed.is_set():
            result = self.manager.get_result(timeout=0.1)
            if result is None:
                if self.manager._generation_thread is None or not self.manager.is_running():
                    break
                continue
            with self._lock:
                entry = self._waiting.pop(result.request_id, None)
            if entry is not None:
                entry[1].append(result)
                entry[0].set()
        with self._lock:  # the generation thread ended: nobody waits forever
            for event, _ in self._waiting.values():
                event.set()
            self._waiting.clear()

    def ask(self, messages: list[dict], tools: list | None, seed: int) -> Answer:
        try:
            text = render_chat(self.tokenizer, messages, tools, True, self.template_kwargs)
        except Exception as e:  # noqa: BLE001  (a template refusing the conversation)
            raise AnswerError("chat_template_error", f"the chat template cannot render the prompt "
                              f"({type(e).__name__})", retry=False) from None
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        event, box = threading.Event(), []
        with self._lock:
            self._counter += 1
            request_id = f"hsx-{self._counter}"
            self._waiting[request_id] = (event, box)
        queued = self.manager.add_request(list(prompt), request_id=request_id,
                                          max_new_tokens=self.sampling.max_new_tokens, eos_token_id=sorted(self.eos))
        if queued is None:  # (the manager takes no more requests: it is stopping, or failed)
            with self._lock:
                self._waiting.pop(request_id, None)
            raise AnswerError("engine_stopped", "the continuous batching engine takes no more requests", retry=False,
                              unreachable=True)
        event.wait()
        if not box:
            raise AnswerError("engine_stopped", "the continuous batching engine stopped", retry=False,
                              unreachable=True)
        from transformers.generation.continuous_batching.requests import RequestStatus

        result = box[0]
        if result.error is not None or result.status != RequestStatus.FINISHED:
            raise AnswerError("engine_error", f"generation failed: {str(result.error)[:200]}", retry=False)
        ids = [int(t) for t in result.generated_tokens]
        stop = bool(ids) and ids[-1] in self.eos
        text_ids = ids[:-1] if stop else ids
        content = self.tokenizer.decode(text_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return Answer(content, "stop" if stop else "length", ids, "engine")

    def close(self) -> None:
        self._closed.set()
        try:
            self._context.__exit__(None, None, None)
        finally:
            self._reader.join(timeout=5)


# ---- OpenAI-compatible servers ------------------------------------------------------------------------------------

@dataclass
class Server:
    url: str  # the base URL, as OpenAI clients take it (http://host:8000/v1)
    host: str
    port: int
    path: str  # .../chat/completions
    https: bool
    in_flight: int = 0
    failures: int = 0  # consecutive
    down_until: float = 0.0
    token_ids: bool = True  # False once the server refused return_token_ids (answers are then tokenized)
    answered: int = 0
    errors: int = 0


def parse_servers(spec: str) -> list[Server]:
    servers = []
    for raw in [s.strip() for s in spec.split(",") if s.strip()]:
        u = urllib.parse.urlsplit(raw if "://" in raw else "http://" + raw)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise HsxError(f"--servers: {raw!r} is not an http(s) URL (e.g. http://host:8000/v1)")
        try:
            port = u.port or (443 if u.scheme == "https" else 80)
        except ValueError:
            raise HsxError(f"--servers: {raw!r} has no valid port") from None
        base = u.path.rstrip("/") or "/v1"
        servers.append(Server(raw, u.hostname, port, base + "/chat/completions", u.scheme == "https"))
    if not servers:
        raise HsxError("--servers: no URL given")
    if len({s.url for s in servers}) != len(servers):
        raise HsxError("--servers: a URL is given twice")
    return servers


@dataclass
class ServerPool:
    """OpenAI-compatible chat servers: each request goes to the least loaded server that is up, at most
    `concurrency` at a time each; a failed request is asked again elsewhere after a backoff, `retries` times, and a
    server that did not answer (or answered 429/5xx) is left alone for a while (1 s, doubling per consecutive
    failure, up to a minute)."""
    servers: list[Server]
    model_name: str
    tokenizer: Any
    sampling: Sampling
    template_kwargs: dict[str, Any]
    concurrency: int
    timeout: float
    retries: int
    vocab_size: int
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _local: threading.local = field(default_factory=threading.local)

    def _acquire(self, avoid: Server | None) -> Server:
        with self._cond:
            while True:
                now = time.monotonic()
                free = [s for s in self.servers if s.in_flight < self.concurrency and s.down_until <= now]
                if len(free) > 1 and avoid in free:
                    free.remove(avoid)
                if free:
                    s = min(free, key=lambda s: (s.in_flight, s.failures))
                    s.in_flight += 1
                    return s
                soonest = min((s.down_until for s in self.servers if s.down_until > now), default=now + 0.5)
                self._cond.wait(timeout=max(0.01, min(soonest - now, 0.5)))

    def _release(self, s: Server, error: AnswerError | None = None) -> None:
        """A server that answered wrongly stays up (the next answer may be right); one that did not answer, or
        said it is overloaded or broken (HTTP 429, 5xx), is left alone for a while."""
        with self._cond:
            s.in_flight -= 1
            if error is None:
                s.failures, s.answered = 0, s.answered + 1
            else:
                s.errors += 1
                if error.unreachable or error.reason == "server_error":
                    s.failures += 1
                    s.down_until = time.monotonic() + min(60.0, 2.0 ** (s.failures - 1))
            self._cond.notify_all()

    def ask(self, messages: list[dict], tools: list | None, seed: int) -> Answer:
        last: AnswerError | None = None
        avoid = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(30.0, 0.25 * 2 ** (attempt - 1)) * (0.5 + random.random()))
            s = self._acquire(avoid)
            try:
                answer = self._post(s, messages, tools, seed)
            except AnswerError as e:
                self._release(s, e)
                last, avoid = e, s
                if not e.retry:
                    raise
                continue
            self._release(s)
            return answer
        assert last is not None
        raise AnswerError(last.reason, f"{last} (after {self.retries + 1} attempts)", unreachable=last.unreachable)

    def _connection(self, s: Server) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(s.url)
        if conn is None:
            cls = http.client.HTTPSConnection if s.https else http.client.HTTPConnection
            conn = conns[s.url] = cls(s.host, s.port, timeout=min(self.timeout, 30.0))
        return conn

    def _drop_connection(self, s: Server) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(s.url, None)
        if conn is not None:
            conn.close()

    def _body(self, s: Server, messages: list[dict], tools: list | None, seed: int) -> dict[str, Any]:
        p = self.sampling
        body: dict[str, Any] = {"model": self.model_name, "messages": messages, "max_tokens": p.max_new_tokens,
                                "temperature": p.temperature, "top_p": p.top_p, "seed": seed, "stream": False}
        if p.top_k:
            body["top_k"] = p.top_k  # (vLLM's and SGLang's extension)
        if tools:
            body["tools"] = tools
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs  # (vLLM's and SGLang's extension)
        if s.token_ids:
            body["return_token_ids"] = True  # vLLM, SGLang: choices[i].token_ids, the ids it generated
        return body

    def _post(self, s: Server, messages: list[dict], tools: list | None, seed: int) -> Answer:
        body = self._body(s, messages, tools, seed)
        status, data = self._exchange(s, json.dumps(body, ensure_ascii=False).encode())
        if status in (400, 422) and "return_token_ids" in body and b"return_token_ids" in data:
            s.token_ids = False  # a strict server (`transformers serve`): ask without it, tokenize what it says
            body.pop("return_token_ids")
            status, data = self._exchange(s, json.dumps(body, ensure_ascii=False).encode())
        if status == 429 or status >= 500:
            raise AnswerError("server_error", f"{s.url} answered HTTP {status}")
        if status != 200:
            raise AnswerError("request_refused", f"{s.url} refused the request: HTTP {status} "
                              f"{_snippet(data)}", retry=status in (408, 409))
        return self._answer(s, data)

    def _exchange(self, s: Server, payload: bytes) -> tuple[int, bytes]:
        """(status, body) of one POST within `timeout` seconds in all, reading at most what an answer can take."""
        deadline = time.monotonic() + self.timeout
        limit = RESPONSE_BASE_BYTES + RESPONSE_BYTES_PER_TOKEN * self.sampling.max_new_tokens
        for fresh in (False, True):  # a kept-alive connection the server closed meanwhile: once more, anew
            conn = self._connection(s)
            try:
                conn.timeout = max(0.1, min(30.0, deadline - time.monotonic()))
                if conn.sock is not None:
                    conn.sock.settimeout(conn.timeout)
                conn.request("POST", s.path, body=payload, headers={"Content-Type": "application/json",
                                                                    "Accept": "application/json"})
                response = conn.getresponse()
                chunks, size = [], 0
                while True:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the answer did not finish in time")
                    # read1: what one receive brings (read would wait for all 64 KiB, and a server sending a
                    # byte at a time would hold it past the deadline)
                    chunk = response.read1(1 << 16) if response.length != 0 else b""
                    if not chunk:
                        break
                    size += len(chunk)
                    if size > limit:
                        raise AnswerError("response_too_large", f"{s.url} sent over {limit:,} bytes for one answer")
                    chunks.append(chunk)
                if response.length:  # the connection ended before the body it announced: cut mid-answer
                    raise AnswerError("truncated_response", f"{s.url} closed the connection {response.length:,} "
                                      "bytes before the end of its answer", unreachable=True)
                response.read()  # (the body is all read: this marks it so, freeing the connection for the next)
                if response.will_close:
                    self._drop_connection(s)
                return response.status, b"".join(chunks)
            except AnswerError:
                self._drop_connection(s)
                raise
            except (http.client.RemoteDisconnected, http.client.ImproperConnectionState, BrokenPipeError,
                    ConnectionResetError) as e:
                self._drop_connection(s)
                if fresh:
                    raise AnswerError("server_unreachable", f"{s.url}: {type(e).__name__}", unreachable=True) from None
            except (TimeoutError, OSError, http.client.HTTPException) as e:
                self._drop_connection(s)
                timed_out = isinstance(e, TimeoutError) or "timed out" in str(e)
                raise AnswerError("timeout" if timed_out else "server_unreachable",
                                  f"{s.url}: {'no answer within ' + str(self.timeout) + ' s' if timed_out else e}",
                                  unreachable=True) from None
        raise AssertionError("unreachable")

    def _answer(self, s: Server, data: bytes) -> Answer:
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise AnswerError("malformed_response", f"{s.url} sent a body that is not JSON: {_snippet(data)}") from None
        choices = doc.get("choices") if isinstance(doc, dict) else None
        choice = choices[0] if isinstance(choices, list) and len(choices) == 1 else None
        message = choice.get("message") if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            raise AnswerError("malformed_response", f"{s.url} sent no choice with a message")
        served = doc.get("model")
        if isinstance(served, str) and served and served != self.model_name:
            raise AnswerError("wrong_model", f"{s.url} answered as model {served[:80]!r}, not {self.model_name!r}")
        content = message.get("content")
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        calls = message.get("tool_calls") or None
        finish = choice.get("finish_reason")
        if not (content is None or isinstance(content, str)) or not (reasoning is None or isinstance(reasoning, str)):
            raise AnswerError("malformed_response", f"{s.url} sent content that is not text")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise AnswerError("malformed_response", f"{s.url} sent tool_calls that are not a list of calls")
        if finish not in FINISH_REASONS:
            raise AnswerError("bad_finish_reason", f"{s.url} gave finish_reason {str(finish)[:40]!r}")
        if content is None and calls is None:
            raise AnswerError("malformed_response", f"{s.url} sent an answer without content")
        try:  # (JSON's \ud800 escapes decode to text no file can hold)
            json.dumps([content, reasoning, calls], ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise AnswerError("malformed_response", f"{s.url} sent text that is not Unicode (a lone surrogate)") \
                from None
        ids = choice.get("token_ids")
        if ids is not None:
            return Answer(content, finish, self._checked_ids(s, ids, content, reasoning, doc), "engine",
                          reasoning, calls)
        if reasoning is None and calls is None and content is not None:
            tokens = self.tokenizer(content, add_special_tokens=False)["input_ids"]
            if len(tokens) > self.sampling.max_new_tokens + 1:
                raise AnswerError("answer_too_long", f"{s.url} sent {len(tokens)} tokens of text, more than the "
                                  f"{self.sampling.max_new_tokens} asked for")
            return Answer(content, finish, list(tokens), "tokenized", None, None)
        return Answer(content, finish, None, "none", reasoning, calls)

    def _checked_ids(self, s: Server, ids: Any, content: str | None, reasoning: str | None, doc: dict) -> list[int]:
        if not (isinstance(ids, list) and all(type(t) is int and 0 <= t < self.vocab_size for t in ids)):
            raise AnswerError("bad_token_ids", f"{s.url} sent token_ids that are not ids of the vocabulary")
        if len(ids) > self.sampling.max_new_tokens + 1:
            raise AnswerError("answer_too_long", f"{s.url} sent {len(ids)} token ids, more than the "
                              f"{self.sampling.max_new_tokens} asked for")
        usage = doc.get("usage")
        told = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if type(told) is int and told != len(ids):
            raise AnswerError("bad_token_ids", f"{s.url} sent {len(ids)} token ids for {told} completion tokens")
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        for part in (reasoning, content):
            if part and part.strip() and part.strip() not in text:
                raise AnswerError("token_ids_disagree", f"{s.url} sent token ids that do not decode to its text")
        return ids

    def close(self) -> None:
        for conn in self._local.__dict__.get("conns", {}).values():
            conn.close()


def _snippet(data: bytes) -> str:
    text = data[:160].decode("utf-8", "replace")
    return " ".join(text.split())[:120]
