"""usage.prompt_tokens_details.cached_tokens (--enable-prompt-tokens-details) with
several choices or prompts, as vLLM 0.12 reports it.

vLLM runs each of n samples as a child request and takes num_cached_tokens from the
child whose output it is turning into a RequestOutput: a full response reports the
child of the last prompt that finished last, a stream the child whose first output
came first.  The count is never summed, and a count of 0 sets no details at all
(null in a body, absent from the usage chunk).

With --max-num-seqs 1 the worker runs the choices one after the other in the order
they were sent, so choice 0 of a new prompt misses the prefix cache and choice 1 hits
the blocks choice 0 left behind: every case below is deterministic.  (n > 1 needs
sampling: vLLM refuses it with temperature 0, hence temperature 1 and a seed.)"""
import json

import requests

PARAGRAPH = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small brass lamp and a notebook in which he recorded the colour of the sky, the "
    "direction of the wind, and the names of the ships that passed beyond the reef. "
    "Over forty years the notebooks filled three shelves in the cottage below, and "
    "nobody but the keeper had ever read a single page of them."
)
OTHER = (
    "In the mountain village the baker rose long before the sun, kneading dough by the "
    "light of a single candle while the river outside ran loud with melted snow. Her "
    "bread was famous across the valley, and travellers would walk for hours along the "
    "narrow path just to buy one warm loaf before it sold out at noon."
)
THIRD = (
    "Every spring the river flooded the lower meadow, and the children of the farm "
    "waded out to rescue the ducks that had nested too close to the water, carrying "
    "them back in baskets lined with straw while their mother watched from the gate "
    "and their father counted the fence posts that the current had carried away."
)
SHORT = "Hi"   # under one KV block: never a prefix-cache hit


def model_of(base):
    return requests.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]


def post(base, path, body):
    r = requests.post(base + path, json={"model": model_of(base), "temperature": 1.0, "seed": 7, "max_tokens": 4, **body},
                      timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream_events(base, path, body):
    r = requests.post(base + path, json={"model": model_of(base), "temperature": 1.0, "seed": 7, "max_tokens": 4, "stream": True,
                                         **body}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    events = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_cached_tokens_follow_vllm_children(serve):
    base = serve("--max-num-seqs", "1", "--enable-prompt-tokens-details").base

    # Full response, n=2: the choice that finished last (1) hit choice 0's blocks.
    usage = post(base, "/v1/completions", {"prompt": PARAGRAPH, "n": 2})["usage"]
    assert usage["prompt_tokens_details"] is not None, usage
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage

    # The same through chat.
    usage = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": OTHER}], "n": 2})["usage"]
    assert usage["prompt_tokens_details"] is not None, usage
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0, usage

    # Several prompts: only the last prompt's count (SHORT: 0, so no details), not a
    # sum with PARAGRAPH's hits.
    usage = post(base, "/v1/completions", {"prompt": [PARAGRAPH, SHORT]})["usage"]
    assert usage["prompt_tokens_details"] is None, usage

    # A stream, n=2: the first output was choice 0's, which missed: no details in the
    # usage chunk, and none in the per-chunk usage either (vLLM never puts them there).
    events = stream_events(base, "/v1/completions", {
        "prompt": THIRD, "n": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert events[0]["choices"][0]["index"] == 0
    final = events[-1]
    assert final["choices"] == [] and "prompt_tokens_details" not in final["usage"], final
    for ev in events[:-1]:
        assert "prompt_tokens_details" not in (ev.get("usage") or {}), ev

    # A repeat of the chat above hits for its first choice too: the stream reports it.
    events = stream_events(base, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": OTHER}], "n": 2, "stream_options": {"include_usage": True}})
    final = events[-1]
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, final
