"""Two sgl_lite replicas behind the real sglang-router (Rust binary, loopback only), via sgl_lite.cluster.

The router is SGLang's own: these tests fail if the HTTP front does not speak the worker API the
router expects (registration, load reports, request shapes), if cache-aware routing does not keep a
conversation on the replica that holds its prefix, or if a replica's death loses requests.
Expected values come from the replicas themselves (their server_info, their meta_info), never from
constants.
"""

from __future__ import annotations

import concurrent.futures
import random
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

sglang_router = pytest.importorskip("sglang_router")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from waiting import wait_until  # noqa: E402

from sgl_lite.cluster import Cluster, free_port, router_command  # noqa: E402
from sgl_lite.runtime.server_args import ServerArgs  # noqa: E402

pytestmark = pytest.mark.timeout(90)

# Faster failure detection than the router's production defaults (60 s health checks, a circuit that
# opens after 10 failures). Two failed health checks 2 s apart mark a dead worker unhealthy, so the
# requests that meet it right after its death are certainly handled by the retries, not the checker.
ROUTER_TEST_FLAGS = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2",
                     "--cb-failure-threshold", "2", "--retry-max-retries", "8",
                     "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "500"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    args = ServerArgs(model_path=str(tiny_llama_dir), dtype="float32", log_level="warning")
    metrics_port = free_port()
    c = Cluster(args.replace(port=free_port()), dp=2, router_policy="cache_aware", startup_timeout=80,
                router_args=ROUTER_TEST_FLAGS + ["--prometheus-port", str(metrics_port)])
    c.start()
    c.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"  # type: ignore[attr-defined]
    try:
        yield c
    finally:
        c.stop()


def generate(base_url: str, text: str, params: dict[str, Any] = GREEDY) -> dict[str, Any]:
    response = requests.post(base_url + "/generate", json={"text": text, "sampling_params": params}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def conversations(tag: str, count: int, turns: int) -> list[list[str]]:
    """User messages of `count` distinct multi-turn conversations (distinct system prompts)."""
    rng = random.Random(tag)
    topics = ["the quick brown fox", "the capital of France", "a journey of a thousand miles",
              "the weather in Paris", "numbers 0 1 2 3 4 5", "a helpful assistant", "Berlin and Germany"]
    out = []
    for c in range(count):
        system = f"<|im_start|>system\nConversation {tag}-{c} about {rng.choice(topics)}. " * 3
        out.append([system] + [f"Question {t} of {tag}-{c}: what about {rng.choice(topics)}?" for t in range(turns)])
    return out


def run_multi_turn(base_url: str, tag: str, count: int = 6, turns: int = 4) -> list[list[dict[str, Any]]]:
    """Turn by turn, all conversations per turn in a seeded random order; each prompt is the whole
    history so far (previous prompt + answer + new question). Returns meta_info per conversation/turn."""
    convs = conversations(tag, count, turns)
    histories = [conv[0] for conv in convs]
    metas: list[list[dict[str, Any]]] = [[] for _ in convs]
    order = list(range(count))
    rng = random.Random(tag + "-order")
    for turn in range(turns):
        rng.shuffle(order)
        for c in order:
            prompt = histories[c] + f"<|im_start|>user\n{convs[c][turn + 1]}<|im_end|>\n<|im_start|>assistant\n"
            out = generate(base_url, prompt)
            metas[c].append(out["meta_info"])
            histories[c] = prompt + out["text"] + "<|im_end|>\n"
    return metas


def hit_rate(metas: list[list[dict[str, Any]]]) -> float:
    cached = sum(m["cached_tokens"] for conv in metas for m in conv)
    prompt = sum(m["prompt_tokens"] for conv in metas for m in conv)
    return cached / prompt


def router_counter(cluster: Cluster, name: str) -> float:
    """Sum of the router's Prometheus counter `name` over all its label sets."""
    text = requests.get(cluster.metrics_url, timeout=10).text  # type: ignore[attr-defined]
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def flush_all(cluster: Cluster) -> None:
    for url in cluster.worker_urls:
        assert requests.post(url + "/flush_cache", timeout=10).status_code == 200


def test_metrics_urls_of_the_replicas_and_the_router(cluster: Cluster) -> None:
    *replicas, router = cluster.metrics_urls
    assert router == cluster.metrics_url  # type: ignore[attr-defined]
    assert len(replicas) == 2
    for url in replicas:
        names = {f.name for f in text_string_to_metric_families(requests.get(url, timeout=10).text)}
        assert {"sglang:num_running_reqs", "sglang:token_usage", "sglang:generation_tokens"} <= names
    assert requests.get(router, timeout=10).status_code == 200


def test_worker_api_shapes_the_router_reads(cluster: Cluster) -> None:
    worker = cluster.worker_urls[0]
    load = requests.get(worker + "/get_load", timeout=10).json()
    assert isinstance(load, list) and load[0]["dp_rank"] == 0 and isinstance(load[0]["num_tokens"], int)
    info = requests.get(worker + "/server_info", timeout=10).json()
    runtime_args = info["server_args"]
    assert info["model_path"] and info["tp_size"] == 1 and info["dp_size"] == 1
    assert info["max_prefill_tokens"] == runtime_args["max_prefill_tokens"]
    model_info = requests.get(worker + "/model_info", timeout=10).json()
    assert model_info["is_generation"] is True and model_info["architectures"] == ["LlamaForCausalLM"]
    assert model_info["served_model_name"] == info["served_model_name"]
    # The runtime's chat template (beyond SGLang's keys), passed on by the router: DSL clients read it there.
    assert model_info["chat_template"] == info["chat_template"] and "{%" in info["chat_template"]
    assert requests.get(cluster.url + "/get_model_info", timeout=10).json()["chat_template"] == info["chat_template"]
    assert requests.get(worker + "/health_generate", timeout=30).status_code == 200
    # The router parsed every worker's load report (-1 means it could not) and registered their model.
    loads = requests.get(cluster.url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(cluster.worker_urls)
    assert all(w["load"] >= 0 for w in loads), loads
    workers = requests.get(cluster.url + "/workers", timeout=10).json()["workers"]
    assert {w["model_id"] for w in workers} == {info["served_model_name"]}


def test_requests_through_the_router(cluster: Cluster) -> None:
    prompt = "The quick brown fox jumps over"
    direct = generate(cluster.worker_urls[1], prompt)
    routed = generate(cluster.url, prompt)
    assert routed["output_ids"] == direct["output_ids"] and routed["text"] == direct["text"]
    model = requests.get(cluster.worker_urls[0] + "/v1/models", timeout=30).json()["data"][0]["id"]  # the served name
    chat = requests.post(cluster.url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 5, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] >= 1
    completion = requests.post(cluster.url + "/v1/completions", timeout=30,
                            json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == direct["text"]
    # SGLang's extra /generate fields pass through the router: token texts in logprobs are honoured,
    # features sgl_lite lacks are refused with the field named.
    body = {"text": prompt, "sampling_params": GREEDY, "return_logprob": True, "return_text_in_logprobs": True}
    named = requests.post(cluster.url + "/generate", json=body, timeout=30).json()["meta_info"]
    assert [token_id for _, token_id, _ in named["output_token_logprobs"]] == direct["output_ids"]
    assert all(isinstance(text, str) and text for _, _, text in named["output_token_logprobs"])
    refused = requests.post(cluster.url + "/generate", json={"text": prompt, "return_hidden_states": True}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_hidden_states"
    models = requests.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [requests.get(cluster.worker_urls[0] + "/v1/models").json()["data"][0]["id"]]


def test_later_turns_hit_the_cache_through_the_router(cluster: Cluster) -> None:
    flush_all(cluster)
    metas = run_multi_turn(cluster.url, "cached")
    assert len(metas) == 6 and all(len(conv) == 4 for conv in metas)  # every conversation ran every turn
    for conv in metas:
        assert all(m["cached_tokens"] > 0 for m in conv[1:]), [m["cached_tokens"] for m in conv]
        # The cached part covers at least the previous turn's prompt minus a few boundary tokens.
        for earlier, later in zip(conv, conv[1:]):
            assert later["cached_tokens"] >= earlier["prompt_tokens"] - 4


def test_cache_aware_beats_round_robin(cluster: Cluster) -> None:
    flush_all(cluster)
    cache_aware = hit_rate(run_multi_turn(cluster.url, "compare"))
    flush_all(cluster)
    port = free_port()
    cmd = router_command(cluster.worker_urls, "127.0.0.1", port, "round_robin", log_level="warn")
    router = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: router.poll() is not None or _router_has_workers(url, len(cluster.worker_urls)),
                   "the round_robin router to list its workers", 30, poll_s=0.1)
        assert router.poll() is None, "round_robin router did not start"
        round_robin = hit_rate(run_multi_turn(url, "compare"))
    finally:
        router.terminate()
        router.wait(10)
    assert cache_aware > round_robin + 0.1, (cache_aware, round_robin)


def _router_has_workers(url: str, expected: int) -> bool:
    try:
        workers = requests.get(url + "/workers", timeout=2).json()["workers"]
    except (requests.RequestException, ValueError, KeyError):
        return False
    return sum(1 for w in workers if w.get("is_healthy")) >= expected


def test_replica_killed_mid_run_loses_no_request(cluster: Cluster) -> None:
    prompts = [f"Request {i}: the weather in Paris is" for i in range(60)]
    expected = {p: generate(cluster.worker_urls[0], p)["output_ids"] for p in prompts[:5]}
    served_before = [requests.get(u + "/server_info", timeout=10).json()["prompt_tokens_total"] for u in cluster.worker_urls]

    def send(prompt: str) -> dict[str, Any]:
        time.sleep(0.02)  # spread the run so that the kill lands in its middle
        return generate(cluster.url, prompt)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, p) for p in prompts]
        futures[len(prompts) // 3].result()
        victim_served = requests.get(cluster.worker_urls[1] + "/server_info", timeout=10).json()["prompt_tokens_total"]
        retries_before = router_counter(cluster, "smg_worker_retries_total")
        cluster.replicas[1].process.kill()  # its HTTP front follows it (it watches its parent)
        results = [f.result(timeout=60) for f in futures]  # each raises if its request failed

    assert len(results) == len(prompts)
    assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in results)
    for prompt, result in zip(prompts, results):
        if prompt in expected:
            assert result["output_ids"] == expected[prompt]
    # Both replicas took part before the kill; requests that met the dead one were retried on the survivor.
    assert victim_served > served_before[1]
    assert router_counter(cluster, "smg_worker_retries_total") > retries_before
    # The survivor served requests during the run, and the router no longer lists the dead one as healthy.
    served_after = requests.get(cluster.worker_urls[0] + "/server_info", timeout=10).json()["prompt_tokens_total"]
    assert served_after > served_before[0]
    def health() -> dict[str, bool]:
        return {w["url"]: w["is_healthy"] for w in requests.get(cluster.url + "/workers", timeout=5).json()["workers"]}

    wait_until(lambda: health().get(cluster.worker_urls[1]) is not True,
               lambda: f"the dead replica listed unhealthy, not {health()}", 10, poll_s=0.2)
    assert generate(cluster.url, "after the failover")["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
