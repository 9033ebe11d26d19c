"""Standard OpenAI clients against `areal serve` over real loopback HTTP: echo and prompt log-probs (the
log-likelihood requests of evaluation harnesses), top alternatives of log-probs, streaming with the
`openai` package, a client that goes away mid-stream, and lm-evaluation-harness's `local-completions`.

One module-scoped server (the tiny random Qwen2 of conftest, with a chat template) answers every test.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import torch

from arealcli.runtime.clients import launcher
from tests.conftest import tiny_module, write_jsonl
from tests.test_server import get, own_logprobs, post, start_servers

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}a: {% endif %}"
)
PROMPTS = ["max(3,9,4)=", "abc", "x"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, char_tok):
    """(server, model directory, the same model in process)."""
    import copy

    model_dir = tmp_path_factory.mktemp("oai-clients") / "model"
    module = tiny_module(char_tok, seed=0)
    module.save_pretrained(model_dir)
    tok = copy.deepcopy(char_tok)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(model_dir)
    servers = start_servers(model_dir, tmp_path_factory.mktemp("oai-clients-logs"))
    yield servers[0], model_dir, module
    launcher.stop(servers)


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{served[0].address}/v1", api_key="unused", max_retries=0)


def in_process(module, ids: list[int]) -> torch.Tensor:
    """(len(ids), V) fp32 log-softmax of the model's logits over `ids` (row p predicts ids[p + 1])."""
    with torch.no_grad():
        return torch.log_softmax(module(torch.tensor([ids])).logits[0].float(), -1)


def ids_of(char_tok, text: str) -> list[int]:
    return char_tok(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- echo and log-probs


def test_echo_scores_prompts_as_the_model_does(served, char_tok):
    server, _, module = served
    r = post(
        server,
        "/v1/completions",
        {"prompt": PROMPTS, "echo": True, "logprobs": 3, "max_tokens": 0, "temperature": 0, "seed": 1234},
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for prompt, c in zip(PROMPTS, answer["choices"], strict=True):
        ids = ids_of(char_tok, prompt)
        assert c["text"] == prompt and c["token_ids"] == [] and c["prompt_token_ids"] == ids
        assert c["finish_reason"] == "length"
        lp = c["logprobs"]
        assert lp["tokens"] == list(prompt) and lp["text_offset"] == list(range(len(prompt)))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        own = in_process(module, ids)
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - float(own[p - 1, ids[p]])) < 1e-4
            top = lp["top_logprobs"][p]
            values, best = own[p - 1].topk(3)
            expected = {
                char_tok.decode([t]): float(v) for t, v in zip(best.tolist(), values.tolist(), strict=True)
            }
            listed = list(top.items())
            # the 3 best, best first, then the prompt's own token when it is not among them (as OpenAI)
            assert [t for t, _ in listed[:3]] == list(expected)
            assert all(abs(top[t] - v) < 1e-4 for t, v in expected.items())
            assert list(top.values()) == sorted(top.values(), reverse=True)
            assert prompt[p] in top and len(top) == (3 if prompt[p] in expected else 4)
    assert answer["usage"] == {
        "prompt_tokens": sum(map(len, PROMPTS)),
        "completion_tokens": 0,
        "total_tokens": sum(map(len, PROMPTS)),
    }


def test_echo_with_generation_and_token_prompts(served, char_tok):
    server, _, module = served
    ids = ids_of(char_tok, "max(3,9,4)=")
    body = {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0}
    c = post(server, "/v1/completions", body).json()["choices"][0]
    out = c["token_ids"]
    assert 1 <= len(out) <= 4
    assert c["text"] == "max(3,9,4)=" + char_tok.decode(out, skip_special_tokens=True)
    lp = c["logprobs"]
    assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + len(out)
    own = in_process(module, ids + out)
    expected = [float(own[p - 1, t]) for p, t in enumerate(ids + out) if p > 0]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expected, strict=True)) < 1e-4
    # greedy: every generated token is the best one
    for k, t in enumerate(out):
        top = lp["top_logprobs"][len(ids) + k]
        assert (
            list(top) == [char_tok.decode([t])]
            and abs(top[char_tok.decode([t])] - expected[len(ids) + k - 1]) < 1e-4
        )
    # as lm-evaluation-harness asks: echo, logprobs 1, max_tokens 1 (the last token is the generated one)
    harness = post(
        server,
        "/v1/completions",
        {"prompt": [ids, ids[:5]], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1},
    ).json()
    assert [len(c["logprobs"]["token_logprobs"]) for c in harness["choices"]] == [len(ids) + 1, 6]
    assert harness["choices"][0]["logprobs"]["token_logprobs"][:-1] == pytest.approx(
        lp["token_logprobs"][: len(ids)], abs=1e-5
    )


def test_refusals_that_remain(served):
    server = served[0]

    def refused(path, body, said):
        r = post(server, path, body)
        assert r.status_code == 400 and said in r.json()["error"]["message"], r.text

    refused("/v1/completions", {"prompt": "a", "seed": 3, "temperature": 1.0}, "seed")
    refused("/v1/completions", {"prompt": "a", "logprobs": 21}, "at most 20")
    refused("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream: true")
    refused("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo")
    refused(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "needs logprobs: true",
    )


def test_chat_logprobs_with_top_alternatives(served, client, char_tok):
    _, _, module = served
    chat = client.chat.completions.create(
        model="p",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    c = chat.choices[0]
    prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    assert char_tok.decode(prompt) == "u: hi\na: " and len(c.logprobs.content) == len(out)
    own = in_process(module, prompt + out)
    for k, (entry, t) in enumerate(zip(c.logprobs.content, out, strict=True)):
        row = own[len(prompt) + k - 1]
        assert entry.token == char_tok.decode([t]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(row[t])) < 1e-4
        values, best = row.topk(3)
        assert [a.token for a in entry.top_logprobs] == [char_tok.decode([b]) for b in best.tolist()]
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best one
    assert own_logprobs(module, prompt, out) == pytest.approx(
        [e.logprob for e in c.logprobs.content], abs=1e-4
    )


# --------------------------------------------------------------------------- streaming


def test_streamed_completions_add_up_to_the_whole_answer(served, client):
    """Greedy answers streamed (several chunks each: the server is slowed down) equal the whole ones. The
    tiny random model repeats a prompt's last character: stop "cd" never matches but every partial answer
    to "abc" ends with its beginning (held back until the end), "ccc" ends it."""
    kwargs = {
        "model": "p",
        "prompt": ["max(3,9,4)=", "abc"],
        "max_tokens": 14,
        "temperature": 0,
        "logprobs": 2,
    }
    assert post(served[0], "/slow_down", {"forward_sleep_time": 0.01}).status_code == 200
    try:
        for extra in ({}, {"stop": ["cd"]}, {"stop": ["x", "ccc"]}, {"echo": True}):
            whole = client.completions.create(**kwargs, **extra)
            chunks = list(client.completions.create(**kwargs, **extra, stream=True))
            check_stream(whole, chunks, several=not extra.get("stop"))
    finally:
        post(served[0], "/slow_down", {"forward_sleep_time": None})


def check_stream(whole, chunks, several: bool) -> None:
    assert all(ch.object == "text_completion" and len(ch.choices) == 1 for ch in chunks)
    parts: dict[int, dict] = {}
    for ch in chunks:
        (c,) = ch.choices
        p = parts.setdefault(
            c.index, {"text": "", "ids": [], "tokens": [], "lps": [], "tops": [], "offsets": []}
        )
        p["text"] += c.text
        p["ids"] += c.model_extra["token_ids"]
        if c.logprobs is not None:
            p["tokens"] += c.logprobs.tokens
            p["lps"] += c.logprobs.token_logprobs
            p["tops"] += c.logprobs.top_logprobs
            p["offsets"] += c.logprobs.text_offset
        if "prompt_token_ids" in c.model_extra:
            p["prompt"] = c.model_extra["prompt_token_ids"]
        p.setdefault("finishes", []).append(c.finish_reason)
    assert sorted(parts) == [c.index for c in whole.choices]
    for w in whole.choices:
        p = parts[w.index]
        assert p["text"] == w.text and p["ids"] == w.model_extra["token_ids"], (p, w)
        assert p["prompt"] == w.model_extra["prompt_token_ids"]
        assert p["finishes"][-1] == w.finish_reason and set(p["finishes"][:-1]) <= {None}
        assert len(p["finishes"]) > 2 or not several  # streamed as it was generated
        assert p["tokens"] == w.logprobs.tokens and p["offsets"] == w.logprobs.text_offset
        assert p["lps"][:1] == w.logprobs.token_logprobs[:1]  # None when echoed
        assert [x for x in p["lps"] if x is not None] == pytest.approx(
            [x for x in w.logprobs.token_logprobs if x is not None], abs=1e-5
        )
        assert [list(t or {}) for t in p["tops"]] == [list(t or {}) for t in w.logprobs.top_logprobs]


def test_what_may_be_streamed_yet():
    from arealcli.runtime.wire.openai import parse_chat_request, parse_completion_request, streamable

    def req(**body):
        return parse_completion_request({"prompt": "x", **body})

    assert streamable("abc", req()) == 3
    assert streamable("abcd", req(stop=["cde"])) == 2  # "cd" may begin the stop text
    assert streamable("ab cde f", req(stop=["cde"])) == 3  # the stop text and what follows never go
    assert streamable("ab\ufffd", req()) == 2  # half a character
    tools = [{"type": "function", "function": {"name": "f"}}]
    chat = parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools},
        lambda m, t, start: ([1], None),
        "<tool_call>",
    )
    assert streamable("Sure. <tool", chat) == 5  # a call may begin: it and the space before it wait
    assert streamable('Sure. <tool_call>{"name"', chat) == 5
    # a call the server started for the model (tool_choice required): the reply is the call's rest, and
    # none of it is content to stream; `start` reaches the renderer
    started = []
    forced = parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"},
        lambda m, t, start: (started.append(start), ([1], None))[1],
        "<tool_call>",
    )
    assert started == ["<tool_call>"] and streamable("abc", forced) == 0


def test_streamed_chat_and_usage(served, client):
    kwargs = {
        "model": "p",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 10,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2)
    chunks = list(
        client.chat.completions.create(
            **kwargs, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    *body, last = chunks
    assert last.choices == [] and last.usage.model_dump() == whole.usage.model_dump()
    assert all(ch.usage is None for ch in body)
    assert body[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in body)
    ids = [t for ch in body for t in ch.choices[0].model_extra["token_ids"]]
    content = [e for ch in body if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    w = whole.choices[0]
    assert text == w.message.content and ids == w.model_extra["token_ids"]
    assert [e.token for e in content] == [e.token for e in w.logprobs.content]
    assert [[a.token for a in e.top_logprobs] for e in content] == [
        [a.token for a in e.top_logprobs] for e in w.logprobs.content
    ]
    assert body[-1].choices[0].finish_reason == w.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in body[:-1])


def test_a_client_that_goes_away_mid_stream_aborts_its_request(served):
    server = served[0]

    def aborted() -> int:
        return get(server, "/get_server_info").json()["internal_states"][0]["aborted"]

    before = aborted()
    assert post(server, "/slow_down", {"forward_sleep_time": 0.05}).status_code == 200
    try:
        body = {"prompt": "a", "max_tokens": 60, "temperature": 0, "stream": True, "min_tokens": 60}
        received = 0
        with httpx.stream(
            "POST", f"http://{server.address}/v1/completions", json=body, timeout=30, trust_env=False
        ) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    received += 1
                    if received == 3:
                        break  # and the connection closes
        deadline = time.monotonic() + 5
        while aborted() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted() == before + 1  # well before its 60 tokens (3 s at this pace)
    finally:
        post(server, "/slow_down", {"forward_sleep_time": None})
    t0 = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and time.monotonic() - t0 < 2
    assert get(server, "/health").status_code == 200


# --------------------------------------------------------------------------- lm-evaluation-harness

# A task over a local JSONL file (lm-eval's `json` loader): the part both tasks share, then each one's own.
TASK = """
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
doc_to_text: "{{{{prompt}}}}"
target_delimiter: ""
"""
MC_TASK = """
output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """
output_type: generate_until
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_evaluation_harness_against_areal_serve(served, char_tok, tmp_path):
    lm_eval = pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is not installed (pip install lm-eval tenacity)"
    )
    pytest.importorskip("tenacity", reason="lm-eval's API models need tenacity")
    from lm_eval.tasks import TaskManager

    server, _, module = served
    rows = [
        {"prompt": "max(3,9,4)=", "choices": ["3", "9", "4"], "answer": 1, "target": "9"},
        {"prompt": "max(7,2)=", "choices": ["7", "2"], "answer": 0, "target": "7"},
        {"prompt": "min(5,1,8)=", "choices": ["5", "1", "8"], "answer": 1, "target": "1"},
    ]
    data = write_jsonl(tmp_path / "max.jsonl", rows)
    cache = tmp_path / "datasets-cache"
    for name, own in (("mc", MC_TASK), ("gen", GEN_TASK)):
        head = TASK.format(name=f"areal_max_{name}", data=data, cache=cache)
        (tmp_path / f"{name}.yaml").write_text(head + own)
    # lm-eval counts context tokens with a Hugging Face tokenizer: the char tokenizer, saved alone
    # (AutoTokenizer would swap in the qwen2 class from a model directory's config)
    tok_dir = tmp_path / "tokenizer"
    char_tok.save_pretrained(tok_dir)
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": "policy",
            "base_url": f"http://{server.address}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tok_dir),
            "batch_size": 4,
            "max_length": 64,
            "max_retries": 1,
        },
        tasks=["areal_max_mc", "areal_max_gen"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    mc = sorted(out["samples"]["areal_max_mc"], key=lambda s: s["doc_id"])
    correct = []
    for row, sample in zip(rows, mc, strict=True):
        context = ids_of(char_tok, row["prompt"])
        served_lls = [resp[0][0] for resp in sample["resps"]]
        own = []
        for choice in row["choices"]:
            cont = ids_of(char_tok, choice)
            lp = in_process(module, context + cont)
            own.append(sum(float(lp[len(context) + k - 1, t]) for k, t in enumerate(cont)))
        assert served_lls == pytest.approx(own, abs=1e-4)
        correct.append(float(max(range(len(own)), key=own.__getitem__) == row["answer"]))
    assert out["results"]["areal_max_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))
    gen = sorted(out["samples"]["areal_max_gen"], key=lambda s: s["doc_id"])
    for row, sample in zip(rows, gen, strict=True):
        direct = post(
            server,
            "/v1/completions",
            {"prompt": row["prompt"], "max_tokens": 5, "temperature": 0, "stop": ["\n", "<eos>"]},
        ).json()
        assert sample["resps"][0][0] == direct["choices"][0]["text"]


def test_vllms_ignore_eos_runs_every_sample_to_max_tokens():
    from arealcli.runtime.wire.openai import parse_completion_request
    from arealcli.runtime.wire.sglang import ProtocolError

    req = parse_completion_request({"prompt": "max(1,2,3)=", "max_tokens": 8, "ignore_eos": True})
    assert req.sampling.min_new_tokens == req.sampling.max_new_tokens == 8
    default = parse_completion_request({"prompt": "x", "ignore_eos": True})  # completions: max_tokens 16
    assert default.sampling.min_new_tokens == default.sampling.max_new_tokens == 16
    with pytest.raises(ProtocolError, match="ignore_eos must be true or false"):
        parse_completion_request({"prompt": "x", "max_tokens": 2, "ignore_eos": "yes"})


def test_token_in_token_out_generate(served, char_tok):
    """vLLM's /inference/v1/generate (what token-level trainers' clients call): prompt ids in, the
    sampled ids and their log-probs out as `token_id:<id>` entries, the in-process model's numbers."""
    server, _, module = served
    prompt = ids_of(char_tok, "max(3,9,4)=")
    body = {
        "token_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_tokens": 5, "logprobs": 1, "n": 2},
        "request_id": "r1",
    }
    r = post(server, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["request_id"] == "r1" and len(out["choices"]) == 2
    for choice in out["choices"]:
        ids = choice["token_ids"]
        assert ids and choice["finish_reason"] in ("stop", "length")
        entries = choice["logprobs"]["content"]
        assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
        own = own_logprobs(module, prompt, ids)
        assert max(abs(e["logprob"] - v) for e, v in zip(entries, own, strict=True)) < 1e-4
        assert ids == out["choices"][0]["token_ids"]  # greedy: both samples alike
    for bad, why in (
        ({"token_ids": []}, "non-empty list of token ids"),
        ({"token_ids": prompt, "sampling_params": {"logprobs": 5}}, "only the sampled token's log-prob"),
        ({"token_ids": prompt, "sampling_params": {"best_of": 2}}, "unknown sampling_params"),
        ({"token_ids": [10**9]}, "out of the vocabulary"),
    ):
        r = post(server, "/inference/v1/generate", bad)
        assert r.status_code == 400 and why in r.text, (bad, r.text)
