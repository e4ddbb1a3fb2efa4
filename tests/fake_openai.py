"""A fake OpenAI-compatible chat server on loopback (stdlib http.server), well behaved or hostile, for
tests/test_regenerate.py and the `hsx regenerate` overhead figure in docs/benchmarks.md.

`behaviour` "good" answers like vLLM with `return_token_ids`: a deterministic answer to the conversation (a few words
chosen by a hash of it and the seed), its token ids with the end-of-turn token, cut at `max_tokens` (finish_reason
length). "no_ids" refuses `return_token_ids` with HTTP 422 as `transformers serve` does and answers without ids;
"reasoning" adds a reasoning_content. The other behaviours are hostile (HOSTILE): each answer is wrong in one way.

    python tests/fake_openai.py serve --port 8011 --tokenizer hsx/demo/tiny-qwen3 [--delay 0.02]
    python tests/fake_openai.py bench --port 8011 --dataset PROMPTS.jsonl --concurrency 16
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WORDS = ("garden", "river", "morning", "quiet", "seven", "books", "stone", "bright", "table", "over", "light", "soft")
HOSTILE = ("hang", "huge", "malformed", "truncated", "out_of_vocab", "disagree", "http500", "die", "bad_finish",
           "nested", "too_many_ids", "wrong_model", "no_choices", "trickle", "surrogate")


def answer_text(messages: list[dict], seed: int) -> str:
    digest = hashlib.sha256(json.dumps([messages, seed], sort_keys=True).encode()).digest()
    words = [WORDS[b % len(WORDS)] for b in digest[: 3 + digest[0] % 6]]
    return " ".join(words).capitalize() + "."


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # (stop() does not wait for a hostile handler's sleep)
    allow_reuse_address = True

    def __init__(self, tokenizer, behaviour: str = "good", model: str = "fake", delay: float = 0.0, port: int = 0):
        super().__init__(("127.0.0.1", port), _Handler)
        self.tokenizer, self.behaviour, self.model, self.delay = tokenizer, behaviour, model, delay
        self.eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def handle_error(self, request, client_address) -> None:  # a client that hung up: nothing to print
        pass

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"

    def start(self) -> FakeServer:
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def good_answer(self, body: dict[str, Any]) -> dict[str, Any]:
        text = answer_text(body["messages"], body.get("seed", 0))
        thinking = "Thinking " + text.lower() if self.behaviour == "reasoning" else None
        raw = f"<think>\n{thinking}\n</think>\n\n{text}" if thinking else text  # (what a reasoning model generates)
        ids = self.tokenizer(raw, add_special_tokens=False)["input_ids"] + [self.eot]
        finish = "stop"
        if len(ids) > body["max_tokens"] and not thinking:
            ids, finish = ids[: body["max_tokens"]], "length"
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        elif not thinking:
            text = self.tokenizer.decode(ids[:-1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": finish}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if thinking:  # (vLLM's reasoning parser: the think block apart, the ids all that was generated)
            choice["message"]["reasoning_content"] = thinking
        return {"id": "x", "object": "chat.completion", "model": body.get("model", self.model), "choices": [choice],
                "usage": {"completion_tokens": len(ids)}}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, status: int, payload: bytes, length: int | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload) if length is None else length))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:  # noqa: N802
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        with s.lock:
            s.requests.append(body)
        if s.delay:
            time.sleep(s.delay)
        b = s.behaviour
        if b == "no_ids" and "return_token_ids" in body:
            return self._send(422, b'{"detail": "Unexpected fields in the request: {\'return_token_ids\'}"}')
        good = s.good_answer(body)
        if b in ("good", "no_ids", "reasoning"):
            return self._send(200, json.dumps(good).encode())
        if b == "hang":
            time.sleep(30)
            return self._send(200, json.dumps(good).encode())
        if b == "trickle":  # a byte a second: each read is quick, the answer never ends in time
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(60):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
            return None
        if b == "huge":
            return self._send(200, b'{"pad": "' + b"x" * (8 << 20) + b'"}')
        if b == "malformed":
            return self._send(200, b'{"choices": [{"message": ')
        if b == "nested":
            return self._send(200, b"[" * 200_000 + b"]" * 200_000)
        if b == "truncated":
            self._send(200, json.dumps(good).encode()[:20], length=4000)
            self.close_connection = True
            return None
        if b == "die":
            self.close_connection = True
            self.connection.shutdown(2)
            return None
        if b == "http500":
            return self._send(500, b'{"error": "internal"}')
        choice = good["choices"][0]
        if b == "out_of_vocab":
            choice["token_ids"] = [10**9]
        elif b == "disagree":
            choice["token_ids"] = s.tokenizer("Something else entirely", add_special_tokens=False)["input_ids"]
            good["usage"]["completion_tokens"] = len(choice["token_ids"])
        elif b == "too_many_ids":
            choice["token_ids"] = choice["token_ids"] * (body["max_tokens"] + 2)
            good["usage"]["completion_tokens"] = len(choice["token_ids"])
        elif b == "bad_finish":
            choice["finish_reason"] = "banana"
        elif b == "wrong_model":
            good["model"] = "another-model"
        elif b == "no_choices":
            good["choices"] = []
        elif b == "surrogate":  # valid JSON, decoding to text no UTF-8 file can hold
            choice["message"]["content"] = "\ud800" + choice["message"]["content"]
        return self._send(200, json.dumps(good).encode())


def _bench(args) -> None:
    """answers/s of a plain concurrent client (threads, one kept-alive connection each, no checks) over the
    dataset's `prompt` rows, against the server at --port: the baseline `hsx regenerate` is compared with."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    rows = [json.loads(line) for line in open(args.dataset)]
    local = threading.local()

    def ask(row: dict) -> int:
        conn = getattr(local, "conn", None) or http.client.HTTPConnection("127.0.0.1", args.port)
        local.conn = conn
        body = {"model": args.model, "messages": [{"role": "user", "content": row["prompt"]}],
                "max_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "seed": 0, "stream": False}
        if not args.no_token_ids:
            body["return_token_ids"] = True
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type":
                                                                                      "application/json"})
        doc = json.loads(conn.getresponse().read())
        return doc["usage"]["completion_tokens"]

    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(ask, rows))
    elapsed = time.monotonic() - start
    print(json.dumps({"answers": len(rows), "seconds": round(elapsed, 3), "answers_per_s": round(len(rows) / elapsed, 1),
                      "tok_per_s": round(tokens / elapsed, 1)}))


def main() -> None:
    import argparse

    from transformers import AutoTokenizer

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["serve", "bench"])
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--tokenizer", default="hsx/demo/tiny-qwen3")
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--dataset")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--model", default="fake", help="bench: the model name the requests give")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--no-token-ids", action="store_true", help="bench: no return_token_ids (transformers serve)")
    args = p.parse_args()
    if args.mode == "bench":
        return _bench(args)
    server = FakeServer(AutoTokenizer.from_pretrained(args.tokenizer), delay=args.delay, port=args.port)
    server.serve_forever()


if __name__ == "__main__":
    main()
