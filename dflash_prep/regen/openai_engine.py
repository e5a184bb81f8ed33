"""`engine: openai`: the official `openai` client against one or more OpenAI-compatible chat servers (vLLM, SGLang,
TGI, `transformers serve`), the servers users already run.

Concurrency: `max_concurrency` worker threads per server (daemon threads: a run that stops never waits for a
request in flight, which a resume asks again) take requests from one queue, so a faster server takes more of them.
`answer()` may be called from several threads at once.

A request (`Request` -> `/chat/completions`): the messages and tools as they are, `seed`, `max_tokens`,
`temperature` (0 for greedy), `top_p` and the OpenAI penalties as standard fields; the other sampling parameters
(top_k, min_p, repetition_penalty) as top-level extra fields (`extra_sampling: extra_body`: vLLM, SGLang) or inside
one `generation_config` JSON field with `do_sample` (`extra_sampling: generation_config`: `transformers serve`
refuses unknown fields with HTTP 422 and samples only when its generation config says `do_sample`);
`chat_template_kwargs` as an extra field. The answer keeps what the server's parsers return: `content`,
`reasoning_content` (or vLLM's newer `reasoning`) and `tool_calls`, the finish reason and the token counts.

Token ids (`token_ids`): at the start, one probe request (a one-token answer to a fixed conversation) asks for
them with the fields both servers read, `return_token_ids` (vLLM >= 0.10.2; SGLang) and `return_prompt_token_ids`
(SGLang); each ignores the other's. They come back as `choices[0].token_ids` (both) and `prompt_token_ids`, on the
response (vLLM) or on the choice (SGLang); SGLang's `matched_stop` names a stop token the ids may leave out. A
server that answers the probe with ids is asked for them on every request (`token_ids: "returned"`); one that
refuses the fields (`transformers serve`: HTTP 422) or answers without ids is asked without them and the answers are
text only (`token_ids: "none"`, in the engine's identity and the summary). The probe goes the way of every request
(below): a server answering it HTTP 5xx decides nothing until it answers (or is confirmed broken, restarted or
down). The probe's prompt is also what regen/template_check.py compares with the extraction's rendering.

Errors, per request:
- HTTP 4xx other than 408 and 429 (a prompt longer than the context, a bad field, a template the row breaks):
  `Answer(rejected="HTTP <status>: <the server's message>")`, a counted skip of the row, at once;
- a connection refused or reset, a timeout, HTTP 408, 429, 502, 503, 504: retried after `retry_backoff_seconds`,
  doubling (at most 60 s), `max_retries` times; then the server is down: its requests go to the other servers, and
  with none left `answer()` raises EngineUnavailable (the run stops, exit code 1, resumable);
- HTTP 500 (an exception inside the server: `transformers serve` answers a template error so; a server whose
  engine died answers everything so): retried the same way; then, if the server still answers `GET /models`, the
  request is held back, not answered: a rejection counts against a row only when the server answered other requests
  around it. A held request is asked again once its server has answered another one after it; rejected again, it
  is held again, and the next answer of that server confirms it (`Answer.rejected`, a counted skip). A server whose
  `SERVER_ERROR_BREAKER` requests (at least 2 x its concurrency) failed in a row with no answer in between is
  broken, not its rows: it counts as down, and its held requests go back to the queue unanswered (to another
  server; with none left the run stops, exit code 1, and a resume asks them again). With no other work to send, an
  idle worker probes a server holding requests with its last answered request (1 new token) to tell the two apart.

Servers the run manages (regen/servers.py) are restarted instead of counted down: `on_server_down(base_url, why)`
is called from the worker that found it down and returns once the server is back (True: its requests are sent again)
or its restarts are spent (False: it is down).

Why our own retry loop rather than the client's (`max_retries` of `openai.OpenAI`): its waits are fixed (0.5 s
doubling to 8 s), too short to ride out a server restart, and it cannot tell us when a server is spent so that its
requests move to another one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, wait

from dflash_prep.recipe.schema import RecipeError, RegenerateSection
from dflash_prep.regen.engine import FINISH_STOP, Answer, EngineUnavailable, Request

log = logging.getLogger("dflash_prep")

TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
STANDARD_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty")  # OpenAI's own fields
MAX_BACKOFF_SECONDS = 60.0
SERVER_ERROR_BREAKER = 8  # at least this many HTTP 500 rejections in a row (and 2 x the concurrency): broken server
PROBE_IDLE_SECONDS = 1.0  # a worker idle this long probes its server when it holds rejected requests
# How long the client keeps an idle connection for reuse: below the 5 s after which uvicorn (vLLM's, SGLang's and
# transformers serve's HTTP server) closes one. The client's default is those same 5 s, so a request sent on a
# connection idle about that long can meet the server's close and fail as a connection error, which counts toward
# the server being down.
KEEPALIVE_EXPIRY_SECONDS = 2.0


def _http_client():
    """The openai client's own HTTP client (its defaults: connection limits, redirects) with idle connections
    dropped after KEEPALIVE_EXPIRY_SECONDS; None (the client's default) where the openai package does not expose
    its limits."""
    import openai

    try:
        from openai._constants import DEFAULT_CONNECTION_LIMITS as limits
    except ImportError:
        return None
    return openai.DefaultHttpxClient(limits=type(limits)(
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_SECONDS))


class _Server:
    """One base URL: its client, whether it is down, and its worker threads."""

    def __init__(self, base_url: str, api_key: str, timeout_seconds: float):
        import openai

        self.base_url = base_url
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_seconds, max_retries=0,
                                    http_client=_http_client())
        self.down: str | None = None  # why, once down
        self.held: list[_Job] = []  # requests rejected with HTTP 5xx, waiting for another answer of this server
        self.errors_in_a_row = 0  # HTTP 5xx rejections since its last answer
        self.last_answered: Request | None = None  # the probe's request
        self.probing = False

    def served_models(self, tries: int = 3) -> list[str] | None:
        """The model names `GET /models` lists now (10 s a try), or None when the server does not answer. A few
        tries: a server may close a kept-alive connection after an error (uvicorn after an HTTP 500), which fails
        the next request sent on it."""
        for attempt in range(tries):
            try:
                return [m.id for m in self.client.with_options(timeout=10.0).models.list().data]
            except Exception:  # noqa: BLE001 - any failure means "does not answer"
                time.sleep(0.2 * (attempt + 1))
        return None

    def answers_models(self) -> bool:
        return self.served_models() is not None


class _Job:
    """A request waiting for a server, with the future its caller waits on."""

    def __init__(self, request: Request, on_answered=None):
        self.request, self.future, self.on_answered = request, Future(), on_answered
        self.server_rejections = 0  # times a server answered it HTTP 5xx while it answered others
        self.rejection: Answer | None = None

    def resolve(self, answer: Answer) -> None:
        self.future.set_result(answer)
        if self.on_answered is not None:
            self.on_answered(1)


class OpenAIEngine:
    """Answers `Request`s through the servers of `section.base_urls` (the module docstring says how).

    section: the recipe's `regenerate` section (base_urls, max_concurrency, timeout_seconds, max_retries,
    retry_backoff_seconds, extra_sampling, api_key_env). served_model_name: the `model` of every request.
    base_urls: the servers (default `section.base_urls`; the managed servers' own). on_server_down(base_url, why):
    see the module docstring. Raises EngineUnavailable when no server answers `GET /models` at the start,
    RecipeError when one lists models but not `served_model_name`."""

    def __init__(self, section: RegenerateSection, served_model_name: str, base_urls: list[str] | None = None,
                 on_server_down=None):
        self.section, self.model = section, served_model_name
        api_key = os.environ.get(section.api_key_env) or "EMPTY"
        urls = section.base_urls if base_urls is None else base_urls
        self.servers = [_Server(url, api_key, section.timeout_seconds) for url in urls]
        self.total_concurrency = section.max_concurrency * len(self.servers)
        self._breaker_limit = max(SERVER_ERROR_BREAKER, 2 * section.max_concurrency)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self.on_server_down = on_server_down
        self._closed = False
        self.num_requests = self.num_retries = 0
        self._check_servers()
        self.token_id_fields: dict = {}  # the request fields that ask for token ids, once the probe found them
        self.probe_answer: Answer | None = None
        for server in self.servers:
            for i in range(section.max_concurrency):
                threading.Thread(target=self._work, args=(server,), daemon=True,
                                 name=f"dflash-prep-openai-{i}").start()
        try:
            self.token_ids = self._probe_token_ids()
        except BaseException:
            self.close()
            raise

    def _check_servers(self) -> None:
        """Every server answers `GET /models` (retried as a request is), or is marked down; none: EngineUnavailable.
        A server that lists models but not the served model name is refused (RecipeError): every request would
        come back 404."""
        for server in self.servers:
            for attempt in range(self.section.max_retries + 1):
                models = server.served_models()
                if models is not None:
                    break
                if attempt < self.section.max_retries:
                    time.sleep(self._backoff(attempt))
            else:
                server.down = f"{server.base_url} does not answer GET /models"
                log.warning("regenerate: %s; its share goes to the other servers", server.down)
                continue
            if models and self.model not in models:
                raise RecipeError(f"recipe key `regenerate.served_model_name` = {self.model!r}: {server.base_url} "
                                  f"serves {models[:5]}")
        if all(s.down for s in self.servers):
            raise EngineUnavailable(f"no server answers: {'; '.join(s.down for s in self.servers)}")

    def identity(self) -> dict:
        """What decides the text here: the served model's name and how the extra sampling parameters are sent (the
        servers' own weights, template and parsers are theirs: name the served model after them); and whether the
        servers return token ids (`returned` | `none`)."""
        return {"engine": "openai", "served_model_name": self.model, "extra_sampling": self.section.extra_sampling,
                "token_ids": self.token_ids}

    def _probe_token_ids(self) -> str:
        """Ask for a one-token answer to PROBE_MESSAGES with the token-id fields, through the request path (its
        retries, its holding of HTTP 5xx answers, a managed server's restart): "returned" when it comes back with
        ids (every request then asks for them), else "none" (asked again without the fields, which a server may
        refuse). Only a server's definite answer decides: an HTTP 5xx is held and asked again like any request's,
        so a server failing at the start never fixes the job's `token_ids` (a resume against it healthy again would
        be refused as another job); with every server down, EngineUnavailable. The answer is kept (`probe_answer`)."""
        probe = Request(messages=PROBE_MESSAGES, tools=None, sampling={}, seed=0, max_tokens=1)
        self.token_id_fields = dict(TOKEN_ID_FIELDS)
        [answer] = self.answer([probe])
        if answer.rejected is None and answer.completion_token_ids is not None:
            self.probe_answer = answer
            log.info("regenerate: the servers return token ids: the answers' own ids are kept")
            return "returned"
        self.token_id_fields = {}
        [self.probe_answer] = self.answer([probe])
        log.warning("regenerate: the servers return no token ids (%s): the extraction re-tokenizes the answers' text, "
                    "which may differ from the tokens the target generated (docs/ON_POLICY.md)",
                    answer.rejected or "the fields are ignored")
        return "none"

    def answer(self, requests: list[Request], on_answered=None) -> list[Answer]:
        """One Answer per request, in order; on_answered(1) from a worker thread as each one is settled. Raises
        EngineUnavailable when every server is down (or broken); then none of these answers is returned."""
        jobs = [_Job(r, on_answered) for r in requests]
        for job in jobs:
            self._queue.put(job)
        self._fail_if_no_server()
        wait([j.future for j in jobs])
        errors = [j.future.exception() for j in jobs if j.future.exception() is not None]
        if errors:
            raise errors[0]
        return [j.future.result() for j in jobs]

    def close(self) -> None:
        """Stop the worker threads (a request in flight is left to finish in its daemon thread)."""
        self._closed = True
        for _ in range(self.total_concurrency):
            self._queue.put(None)

    # ------------------------------------------------------------------------------------------ workers
    def _work(self, server: _Server) -> None:
        while not self._closed and server.down is None:
            try:
                job = self._queue.get(timeout=PROBE_IDLE_SECONDS)
            except queue.Empty:
                self._probe(server)
                continue
            if job is None:
                return
            if server.down is not None:  # marked down by another of its workers meanwhile
                self._queue.put(job)
                self._fail_if_no_server()
                return
            try:
                answer = self._call(server, job.request)
            except _ServerDown as e:
                self._queue.put(job)  # sent again: to this server once it is back, else to another one
                if not self._server_lost(server, str(e)):
                    return
                continue
            except Exception as e:  # noqa: BLE001 - a bug or an unexpected reply: the caller sees it
                job.future.set_exception(e)
                continue
            if not self._settle(server, job, answer):
                return

    def _settle(self, server: _Server, job: _Job | None, answer: Answer) -> bool:
        """Apply one reply of `server` (job None: a probe's). False when the server turned out broken and is down."""
        if answer.rejected is not None and answer.rejected.startswith("HTTP 5"):
            with self._lock:
                server.errors_in_a_row += 1
                if job is not None:
                    job.server_rejections += 1
                    job.rejection = answer
                    server.held.append(job)
                broken = server.errors_in_a_row >= self._breaker_limit
            if broken:
                return self._server_lost(server, f"{server.errors_in_a_row} requests in a row failed with HTTP 5xx "
                                                 f"(the last: {answer.rejected}): the server is broken, not the rows")
            return True
        with self._lock:
            server.errors_in_a_row = 0
            released, server.held = server.held, []
            if job is not None:
                server.last_answered = job.request
        if job is not None:
            job.resolve(answer)
        for held in released:  # the server answered after them: a first rejection is asked again, a second stands
            if held.server_rejections >= 2:
                held.resolve(held.rejection)
            else:
                self._queue.put(held)
        return True

    def _probe(self, server: _Server) -> None:
        """An idle worker of a server holding rejected requests: its last answered request again (1 new token),
        so a server answering others confirms them and a broken one trips the breaker."""
        with self._lock:
            if not server.held or server.probing or server.down is not None:
                return
            server.probing = True
            request = server.last_answered or Request(messages=[{"role": "user", "content": "Hello"}], tools=None,
                                                      sampling={}, seed=0, max_tokens=1)
        try:
            answer = self._call(server, dataclasses.replace(request, max_tokens=1))
            self._settle(server, None, answer)
        except _ServerDown as e:
            self._server_lost(server, str(e))
        except Exception:  # noqa: BLE001 - a probe's own failure decides nothing
            log.debug("probe of %s failed", server.base_url, exc_info=True)
        finally:
            server.probing = False

    def _server_lost(self, server: _Server, why: str) -> bool:
        """`server` is down or broken: its held requests go back to the queue unanswered (their rejections void).
        A managed server is restarted (True: its workers go on); else, or with its restarts spent, it is down."""
        with self._lock:
            held, server.held = server.held, []
            server.errors_in_a_row = 0
        for job in held:
            job.server_rejections, job.rejection = 0, None
            self._queue.put(job)
        if self.on_server_down is not None and server.down is None and self.on_server_down(server.base_url, why):
            return True
        self._mark_down(server, why)
        self._fail_if_no_server()
        return False

    def _mark_down(self, server: _Server, why: str) -> None:
        with self._lock:
            if server.down is None:
                server.down = why
                left = sum(s.down is None for s in self.servers)
                log.warning("regenerate: server %s is down (%s); %d server(s) left", server.base_url, why, left)

    def _fail_if_no_server(self) -> None:
        """With every server down, end every waiting request with EngineUnavailable."""
        if not all(s.down for s in self.servers):
            return
        error = EngineUnavailable("every server is down: " + "; ".join(f"{s.base_url}: {s.down}" for s in self.servers))
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None and not job.future.done():
                job.future.set_exception(error)

    # ------------------------------------------------------------------------------------------ one request
    def _backoff(self, attempt: int) -> float:
        return min(self.section.retry_backoff_seconds * 2 ** attempt, MAX_BACKOFF_SECONDS)

    def _call(self, server: _Server, request: Request) -> Answer:
        """The request on `server`, retried on transient errors. Raises _ServerDown when the retries are spent."""
        import openai

        kwargs = self.request_kwargs(request)
        last = ""
        for attempt in range(self.section.max_retries + 1):
            if attempt:
                with self._lock:
                    self.num_retries += 1
                time.sleep(self._backoff(attempt - 1))
            try:
                with self._lock:
                    self.num_requests += 1
                return answer_of(server.client.chat.completions.create(**kwargs))
            except openai.APIStatusError as e:
                if e.status_code not in TRANSIENT_STATUS:
                    return Answer(rejected=f"HTTP {e.status_code}: {_message_of(e)}")
                last = f"HTTP {e.status_code}: {_message_of(e)}"
                status = e.status_code
            except openai.APIConnectionError as e:  # refused, reset, timed out (APITimeoutError)
                last, status = f"{type(e).__name__}: {e}", None
        if status == 500 and server.answers_models():
            return Answer(rejected=f"{last} ({self.section.max_retries + 1} attempts)")
        raise _ServerDown(f"{last} after {self.section.max_retries + 1} attempts")

    def request_kwargs(self, request: Request) -> dict:
        """The `chat.completions.create` arguments of a request (the module docstring lists them)."""
        sampling = request.sampling
        kwargs = {"model": self.model, "messages": request.messages, "max_tokens": request.max_tokens,
                  "seed": request.seed, "temperature": float(sampling.get("temperature", 0.0)) if sampling else 0.0}
        if request.tools:
            kwargs["tools"] = request.tools
        for key in STANDARD_SAMPLING[1:]:
            if key in sampling:
                kwargs[key] = sampling[key]
        extra = {k: v for k, v in sampling.items() if k not in STANDARD_SAMPLING}
        body = {}
        if self.section.extra_sampling == "generation_config":
            hf = {k: v for k, v in sampling.items() if k not in ("presence_penalty", "frequency_penalty")}
            body["generation_config"] = json.dumps({"do_sample": bool(sampling), **hf})
        elif extra:
            body.update(extra)
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(request.chat_template_kwargs)
        body.update(self.token_id_fields)
        if body:
            kwargs["extra_body"] = body
        return kwargs


# The probe conversation (template_check.py renders it too) and the fields that ask for token ids (module docstring).
PROBE_MESSAGES = [{"role": "system", "content": "You are a probe."}, {"role": "user", "content": "Say one word."}]
TOKEN_ID_FIELDS = {"return_token_ids": True, "return_prompt_token_ids": True}


class _ServerDown(Exception):
    """A request's retries on one server are spent."""


def _message_of(error) -> str:
    """The server's own words from an HTTP error (its JSON `message`/`detail`/`error`, else the body), one line."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        inner = body.get("error") if isinstance(body.get("error"), dict) else body
        text = inner.get("message") or inner.get("detail") or body.get("error") or body
    else:
        text = body or getattr(error, "message", "") or str(error)
    return " ".join(str(text).split())[:500]


def answer_of(response) -> Answer:
    """A ChatCompletion -> Answer (reasoning from `reasoning_content` or `reasoning`, tool calls as OpenAI dicts)."""
    if not response.choices:
        return Answer(rejected="the server returned no choices")
    choice = response.choices[0]
    message = choice.message
    extra = message.model_extra or {}
    reasoning = extra.get("reasoning_content")
    if reasoning is None:
        reasoning = extra.get("reasoning")
    calls = [c.model_dump(exclude_none=True) for c in message.tool_calls] if message.tool_calls else None
    usage = response.usage
    prompt_ids, completion_ids = _token_ids(response, choice)
    return Answer(content=message.content, reasoning_content=reasoning, tool_calls=calls or None,
                  finish_reason=choice.finish_reason or FINISH_STOP,
                  prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
                  completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
                  prompt_token_ids=prompt_ids, completion_token_ids=completion_ids)


def _int_list(value) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [int(t) for t in value]
    return None


def _token_ids(response, choice) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, completion ids) of a response, where the server returned them: `choices[0].token_ids`, and
    `prompt_token_ids` on the response (vLLM) or the choice (SGLang); a stop token SGLang names in `matched_stop`
    but left out of the ids is put back (the ids end with the token that stopped the turn)."""
    extra = choice.model_extra or {}
    completion = _int_list(extra.get("token_ids"))
    prompt = _int_list(extra.get("prompt_token_ids"))
    if prompt is None:
        prompt = _int_list((response.model_extra or {}).get("prompt_token_ids"))
    stop = extra.get("matched_stop")
    if completion is not None and isinstance(stop, int) and not isinstance(stop, bool) \
            and choice.finish_reason != "length" and (not completion or completion[-1] != stop):
        completion.append(int(stop))
    return prompt, completion
