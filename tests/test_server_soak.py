"""Soak: 200 concurrent streaming clients with random parameters and random
disconnects for a bounded time, against a server with a KV pool small enough
to bound admission. Afterwards: no leaked KV slots, every request that was
not walked away from completed (one finish reason per choice), and the metrics
agree with what was sent."""

import asyncio
import json
import random
import time

import httpx
import pytest

from server_util import ServerThread

CLIENTS = 200
SOAK_SECONDS = 45
MODEL = "soak"


@pytest.mark.slow
@pytest.mark.parametrize("overlap", ["auto", "on"])  # on: the overlap schedule on the CPU too (auto: off there)
def test_soak_200_streaming_clients(llama_ckpt, overlap):
    with ServerThread(llama_ckpt, served_model_name=MODEL, kv_slots=3000, max_running=64,
                      overlap_schedule=overlap) as srv:
        tok = srv.engine.tokenizer
        m0 = srv.metrics()
        stats = {"completed": 0, "walked_away": 0, "choices": 0, "prompt_tokens": 0, "stop": 0, "length": 0,
                 "completion_tokens": 0, "maybe_choices": 0, "maybe_prompt_tokens": 0, "errors": []}

        def prompt_tokens(body) -> int:
            if "prompt" in body:
                return len(tok.encode(body["prompt"], add_special_tokens=False))
            ids = tok.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

        def random_body(rng: random.Random) -> tuple[str, dict]:
            n = rng.choice([1, 1, 1, 2, 3])
            body = {"model": MODEL, "n": n, "max_tokens": rng.randint(1, 48), "stream": rng.random() < 0.85,
                    "temperature": rng.choice([0, 0.5, 1.0, 1.3]), "seed": rng.randrange(1 << 30),
                    "top_p": rng.choice([1.0, 0.9, 0.5])}
            if rng.random() < 0.3:
                body["stop"] = rng.choice([" the", "e", ["a", "o"], "\n"])
            if rng.random() < 0.2:
                body["ignore_eos"] = True
            if rng.random() < 0.2:
                body["presence_penalty"] = rng.uniform(-2, 2)
            words = " ".join(rng.choice(["In", "the", "beginning", "God", "earth", "void", "fox", "dog", "café"])
                             for _ in range(rng.randint(1, 40)))
            if rng.random() < 0.5:
                body["prompt"] = ("In the beginning " * rng.randint(0, 3)) + words  # shared prefixes
                if rng.random() < 0.2:
                    body["logprobs"] = rng.randint(0, 5)
                return "/v1/completions", body
            body["messages"] = [{"role": "user", "content": words}]
            if rng.random() < 0.1:  # a grammar: its rows are sampled only once the step before is finished
                body["response_format"] = {"type": "json_object"}
            if rng.random() < 0.2:
                body["logprobs"] = True
                body["top_logprobs"] = rng.randint(0, 5)
            if body["stream"] and rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            return "/v1/chat/completions", body

        async def one(http: httpx.AsyncClient, rng: random.Random) -> None:
            route, body = random_body(rng)
            walk_after = rng.randint(0, 6) if rng.random() < 0.25 else None
            n = body["n"]
            reasons: dict[int, list] = {}
            if not body["stream"]:
                try:
                    if walk_after is not None:  # give up on the whole response after a moment
                        r = await asyncio.wait_for(http.post(route, json=body), timeout=rng.uniform(0.01, 0.5))
                    else:
                        r = await http.post(route, json=body)
                except asyncio.TimeoutError:
                    # the server may or may not have submitted it before noticing
                    stats["walked_away"] += 1
                    stats["maybe_prompt_tokens"] += prompt_tokens(body)
                    stats["maybe_choices"] += n
                    return
                if r.status_code != 200:
                    stats["errors"].append((r.status_code, r.text[:200]))
                    return
                data = r.json()
                for c in data["choices"]:
                    reasons[c["index"]] = [c["finish_reason"]]
                usage = data["usage"]
            else:
                usage = None
                chunks = 0
                async with http.stream("POST", route, json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append((r.status_code, (await r.aread())[:200]))
                        return
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        msg = json.loads(line[6:])
                        if msg.get("usage"):
                            usage = msg["usage"]
                        for c in msg["choices"]:
                            if c["finish_reason"]:
                                reasons.setdefault(c["index"], []).append(c["finish_reason"])
                        chunks += 1
                        if walk_after is not None and chunks > walk_after:
                            break  # leaving the block closes the connection mid-stream
                    if not done:
                        if walk_after is None:
                            stats["errors"].append(("stream ended without [DONE]", route))
                        else:
                            stats["walked_away"] += 1
                            stats["prompt_tokens"] += prompt_tokens(body)
                            stats["choices"] += n
                        return
            # completed
            if sorted(reasons) != list(range(n)) or any(len(v) != 1 for v in reasons.values()):
                stats["errors"].append(("finish reasons", route, reasons))
            stats["completed"] += 1
            stats["choices"] += n
            stats["prompt_tokens"] += prompt_tokens(body)
            for v in reasons.values():
                stats[v[0]] += 1
            if usage is not None:
                stats["completion_tokens"] += usage["completion_tokens"]
                if usage["prompt_tokens"] != prompt_tokens(body):
                    stats["errors"].append(("usage", usage, prompt_tokens(body)))

        async def client_loop(i: int, deadline: float) -> None:
            rng = random.Random(i)
            limits = httpx.Limits(max_connections=2)
            async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=limits) as http:
                while time.monotonic() < deadline:
                    await one(http, rng)

        async def main():
            deadline = time.monotonic() + SOAK_SECONDS
            await asyncio.gather(*(client_loop(i, deadline) for i in range(CLIENTS)))

        asyncio.run(main())
        assert not stats["errors"], stats["errors"][:10]
        assert stats["completed"] > CLIENTS and stats["walked_away"] > 0
        srv.wait_idle(timeout=120)
        srv.assert_kv_clean()
        m1 = srv.metrics()

        def d(name):
            return m1.get(name, 0) - m0.get(name, 0)

        finished = sum(d(f'stepserve:requests_total{{finished_reason="{r}"}}') for r in ("stop", "length", "abort"))
        # every choice of every accepted request ended exactly once
        assert stats["choices"] <= finished <= stats["choices"] + stats["maybe_choices"]
        assert d('stepserve:requests_total{finished_reason="stop"}') >= stats["stop"]
        assert d('stepserve:requests_total{finished_reason="length"}') >= stats["length"]
        prompt = d("stepserve:prompt_tokens_total")
        assert stats["prompt_tokens"] <= prompt <= stats["prompt_tokens"] + stats["maybe_prompt_tokens"]
        assert d("stepserve:generation_tokens_total") >= stats["completion_tokens"]
        assert d("stepserve:requests_rejected_total") == 0
        assert m1["stepserve:num_requests_running"] == m1["stepserve:num_requests_waiting"] == 0
        assert m1["stepserve:kv_cache_usage_perc"] == 0
        print(stats | {"errors": len(stats["errors"]), "retractions": d("stepserve:retractions_total")})
