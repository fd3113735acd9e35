"""A bounded load-and-fault run against vLLM's OpenAI-compatible server (``tests/serving`` and
``bench/serve_load.py``): :class:`Server` starts vLLM's OpenAI server (``python -m`` its module) on
127.0.0.1 (a free port; its log in a file) and stops it; :func:`plan` makes the traffic (greedy and
sampled, streamed and not, mixed lengths, each good prompt drawn from its own range of ids so a
leaked id names its request, client aborts mid-stream, bad requests interleaved); :func:`drive`
sends it with ``httpx`` at a fixed concurrency until it is done or the deadline passes;
:func:`summary` counts what was served, aborted and rejected and the latencies;
:func:`server_metrics` reads vLLM's Prometheus counters; :func:`worker_stats` reads the files
trimpass's workers write (the ``stats_dir`` setting). Prompts are token ids: the server runs with
``--skip-tokenizer-init`` and answers with ``return_token_ids``."""
from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from trimpass.serving.vllm_compat import API_SERVER

BAD_KINDS = ("too_long", "max_tokens_0", "negative_temperature", "empty_prompt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The OpenAI-compatible server as a context manager; ``args`` are its extra arguments."""

    def __init__(self, model: str, args: list[str], log: str, env: dict | None = None,
                 start_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", API_SERVER, "--host",
                    "127.0.0.1", "--port", str(self.port), "--model", model, *args]
        self.log, self.env, self.start_timeout = log, env, start_timeout
        self.proc = None

    def __enter__(self):
        self._log = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}) before serving; "
                                   f"its log ends:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.__exit__()
        raise TimeoutError(f"the server did not serve within {self.start_timeout:.0f} s; its log "
                           f"ends:\n{self.tail()}")

    def __exit__(self, *exc):
        """SIGINT (vLLM shuts its engine processes down), then SIGKILL after 60 s; returns once
        every process of the server's group is gone, so the next server gets its memory."""
        if self.proc is not None:
            group, deadline = self.proc.pid, time.monotonic() + 60
            try:
                os.killpg(group, 2)
                while time.monotonic() < deadline:
                    self.proc.poll()
                    os.killpg(group, 0)  # raises once the group is empty
                    time.sleep(0.2)
                os.killpg(group, 9)
                while True:
                    self.proc.poll()
                    os.killpg(group, 0)
                    time.sleep(0.2)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()

    def tail(self, n: int = 4000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]


@dataclass
class Req:
    i: int
    prompt: list
    max_tokens: int
    temperature: float = 0.0
    stream: bool = False
    abort_after: int | None = None  # chunks read before the client disconnects
    bad: str | None = None  # one of BAD_KINDS
    xargs: dict | None = None  # the OpenAI API's vllm_xargs (e.g. the request's tenant)


@dataclass
class Result:
    req: Req
    status: int = 0
    tokens: list = field(default_factory=list)
    finish: str | None = None
    aborted: bool = False
    unsent: bool = False  # the run's deadline passed before its turn
    error: str | None = None
    sent: float = 0.0
    first: float | None = None  # seconds to the first token
    gaps: list = field(default_factory=list)  # per-token inter-token latencies (streaming)
    done: float = 0.0


def plan(n: int, V: int, max_model_len: int, *, seed: int = 0, lo: int = 512,
         prompt_len: tuple = (4, 40), max_tokens: tuple = (4, 48), sampled: float = 0.25,
         stream: float = 0.5, abort_every: int = 3, bad_every: int = 8,
         prompts: list | None = None) -> list[Req]:
    """``n`` good requests, one bad one after every ``bad_every`` (cycling through
    :data:`BAD_KINDS`). Good prompt ``i`` draws from its own ids ``[lo + i*w, lo + (i+1)*w)``
    (``w = (V - lo) // n``), or is ``prompts[i % len(prompts)]`` when given; a ``sampled``
    fraction has temperature 0.8 and a seed; a ``stream`` fraction streams, and every
    ``abort_every``-th streamed request disconnects after a few chunks."""
    rng = random.Random(seed)
    w = (V - lo) // n
    if prompts is None and w < 1:
        raise ValueError(f"n: {n} requests need {n} disjoint id ranges above {lo}, V={V} has "
                         f"{V - lo} ids; lower n or lo")
    out, streamed = [], 0
    for i in range(n):
        if prompts is None:
            L = rng.randint(*prompt_len)
            p = [lo + i * w + rng.randrange(w) for _ in range(L)]
        else:
            p = list(prompts[i % len(prompts)])
        r = Req(len(out), p, rng.randint(*max_tokens),
                0.8 if rng.random() < sampled else 0.0, rng.random() < stream)
        if r.stream:
            streamed += 1
            if abort_every and streamed % abort_every == 0:
                r.abort_after = rng.randint(1, 3)
        out.append(r)
        if bad_every and (i + 1) % bad_every == 0:
            kind = BAD_KINDS[(i // bad_every) % len(BAD_KINDS)]
            bad = Req(len(out), [1, 2, 3], 4, bad=kind)
            if kind == "too_long":
                bad.prompt = [1] * (max_model_len + 1)
            elif kind == "max_tokens_0":
                bad.max_tokens = 0
            elif kind == "negative_temperature":
                bad.temperature = -1.0
            else:
                bad.prompt = []
            out.append(bad)
    return out


def _body(model: str, r: Req) -> dict:
    b = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens,
         "temperature": r.temperature, "stream": r.stream, "return_token_ids": True,
         "ignore_eos": True}
    if r.temperature > 0:
        b["seed"] = 1000 + r.i
    if r.xargs is not None:
        b["vllm_xargs"] = r.xargs
    return b


async def _one(client: httpx.AsyncClient, model: str, r: Req) -> Result:
    res = Result(r, sent=time.perf_counter())
    try:
        if not r.stream:
            resp = await client.post("/v1/completions", json=_body(model, r))
            res.status = resp.status_code
            if resp.status_code == 200:
                c = resp.json()["choices"][0]
                res.tokens, res.finish = list(c.get("token_ids") or []), c.get("finish_reason")
                res.first = time.perf_counter() - res.sent
            else:
                res.error = resp.text[:300]
        else:
            async with client.stream("POST", "/v1/completions", json=_body(model, r)) as resp:
                res.status = resp.status_code
                if resp.status_code != 200:
                    res.error = (await resp.aread()).decode(errors="replace")[:300]
                    return res
                last, chunks = res.sent, 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    c = json.loads(line[6:])["choices"][0]
                    toks = list(c.get("token_ids") or [])
                    now = time.perf_counter()
                    if toks:
                        if res.first is None:
                            res.first = now - res.sent
                        else:
                            res.gaps += [(now - last) / len(toks)] * len(toks)
                        last = now
                    res.tokens += toks
                    res.finish = c.get("finish_reason") or res.finish
                    chunks += 1
                    if r.abort_after is not None and chunks >= r.abort_after:
                        res.aborted = True
                        break  # leaving the context closes the connection: vLLM aborts it
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.done = time.perf_counter() - res.sent
    return res


async def _drive(url: str, model: str, reqs: list, concurrency: int, deadline: float):
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0),
                                 limits=limits) as client:
        async def run(r):
            async with sem:
                if time.monotonic() > deadline:
                    return Result(r, unsent=True)
                return await _one(client, model, r)
        return await asyncio.gather(*(run(r) for r in reqs))


def drive(url: str, model: str, reqs: list, concurrency: int, seconds: float) -> tuple:
    """Send ``reqs`` at most ``concurrency`` at a time; none starts after ``seconds``. Returns
    the results in request order and the wall time."""
    t0 = time.perf_counter()
    out = asyncio.run(_drive(url, model, reqs, concurrency, time.monotonic() + seconds))
    return out, time.perf_counter() - t0


def _pct(xs: list, q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(results: list, wall: float) -> dict:
    """Requests sent, served, aborted by the client, rejected (4xx), failed otherwise; tokens/s
    of the served requests; p50/p99 time to first token and per-token inter-token latency
    (ms)."""
    served = [r for r in results if r.status == 200 and not r.aborted and r.error is None]
    ttft = [r.first for r in served if r.first is not None and r.req.stream]
    gaps = [g for r in served for g in r.gaps]
    toks = sum(len(r.tokens) for r in served)

    def ms(v):
        return None if v is None else round(1e3 * v, 2)
    return {"requests": sum(not r.unsent for r in results), "served": len(served),
            "aborted": sum(r.aborted for r in results),
            "rejected": sum(400 <= r.status < 500 for r in results),
            "failed": sum(r.status >= 500 or (r.status == 0 and not r.unsent) for r in results),
            "tokens": toks, "wall_s": round(wall, 2), "tokens_per_s": round(toks / wall, 2),
            "ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p99_ms": ms(_pct(ttft, 0.99)),
            "itl_p50_ms": ms(_pct(gaps, 0.5)), "itl_p99_ms": ms(_pct(gaps, 0.99))}


def greedy_outputs(results: list) -> dict:
    """Request index -> tokens of every greedy request served whole."""
    return {r.req.i: r.tokens for r in results
            if r.status == 200 and not r.aborted and r.req.temperature == 0 and r.req.bad is None}


def flips(a: dict, b: dict) -> tuple[int, int]:
    """(requests whose tokens differ, requests compared) over the ones both runs served."""
    common = sorted(set(a) & set(b))
    return sum(a[i] != b[i] for i in common), len(common)


def server_metrics(url: str) -> dict:
    """vLLM's counters from ``/metrics``, summed over their labels (e.g.
    ``vllm:num_preemptions``, ``vllm:spec_decode_num_accepted_tokens``)."""
    out: dict = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        name = name.split("{", 1)[0].removesuffix("_total")
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def worker_stats(stats_dir: str, until_rows_zero: float = 0.0) -> list[dict]:
    """The trimpass workers' files under ``stats_dir``; with ``until_rows_zero`` > 0, waits up to
    that many seconds for every worker to report 0 live rows (the engine's last step after a
    drain)."""
    deadline = time.monotonic() + until_rows_zero
    while True:
        got = []
        for p in sorted(glob.glob(os.path.join(stats_dir, "trimpass-worker-*.json"))):
            with open(p) as f:
                got.append(json.load(f))
        if not until_rows_zero or time.monotonic() > deadline or (
                got and all(s["rows"] == 0 for s in got)):
            return got
        time.sleep(0.5)
