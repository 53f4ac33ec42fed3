"""The OpenAI API as the official Python SDK sees it, against a running `swarmgate serve`.

Each test makes a few short requests (tens of tokens at most) so that the whole suite stays
within a couple of minutes on two cores. Greedy requests (temperature 0) are deterministic, so
several tests compare one answer with another rather than with fixed text the model might
phrase differently after a tokenizer or kernel change.
"""

import json
import math
import pathlib

import openai
import pytest

from conftest import EMBEDDING_MODEL, MODEL, ROOT

QUESTION = "What is the capital of France? Answer in one sentence."
# The reference embeddings the Rust tests use too, written by scripts/embeddings-reference.py.
REFERENCE = ROOT / "engine" / "tests" / "fixtures" / "minilm_reference.json"


def ask(client, content, **params):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **params
    )


# Chat


def test_chat_answers_a_question(client):
    response = ask(client, QUESTION, temperature=0, max_tokens=32)

    assert response.object == "chat.completion"
    assert response.model == MODEL
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 32
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_sends_role_deltas_finish_reason_and_usage(client):
    expected = ask(client, QUESTION, temperature=0, max_tokens=32)

    stream = ask(
        client,
        QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1, "one id for the whole stream"
    *content_chunks, last = chunks
    # Every chunk but the last has one choice and no usage; the last has usage and no choices.
    assert all(len(c.choices) == 1 and c.usage is None for c in content_chunks)
    assert last.choices == []
    assert content_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == expected.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in content_chunks if c.choices[0].finish_reason]
    assert finish == [expected.choices[0].finish_reason], "one finish_reason, the same"
    assert content_chunks[-1].choices[0].finish_reason is not None
    usage = last.usage
    assert usage is not None, "include_usage asks for a final usage chunk"
    assert usage.prompt_tokens == expected.usage.prompt_tokens
    assert usage.completion_tokens == expected.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_n_2_returns_two_choices(client):
    greedy = ask(client, QUESTION, temperature=0, max_tokens=16, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    first, second = (c.message.content for c in greedy.choices)
    assert first and first == second, "greedy choices of one prompt are the same"

    sampled = ask(client, "Write a line about the sea.", temperature=1.0, seed=7, max_tokens=16, n=2)
    assert [c.index for c in sampled.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason for c in sampled.choices)
    assert sampled.usage.completion_tokens <= 2 * 16


def test_stop_string_ends_the_answer_before_it(client):
    prompt = "Count from 1 to 20, separated by commas."
    free = ask(client, prompt, temperature=0, max_tokens=40).choices[0].message.content
    # A stop string taken from the middle of the greedy answer: the stopped answer must be the
    # greedy one cut just before the stop string's first occurrence.
    stop = "7"
    assert stop in free[1:], f"the greedy answer should count past 7: {free!r}"

    response = ask(client, prompt, temperature=0, max_tokens=40, stop=[stop])

    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.message.content
    assert choice.message.content == free[: free.index(stop)]


def test_same_seed_gives_the_same_sample(client):
    prompt = "Write a line about the sea."

    def sample(seed):
        response = ask(client, prompt, temperature=0.9, seed=seed, max_tokens=24)
        return response.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    # Other seeds: at temperature 0.9, over 24 tokens of free verse, three seeds all giving the
    # same text would mean the seed is ignored.
    assert len({first, sample(1), sample(2)}) > 1


# Completions (legacy)


def test_completion_logprobs(client):
    prompt = "The capital of France is"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, logprobs=2, temperature=0
    )

    assert response.object == "text_completion"
    choice = response.choices[0]
    logprobs = choice.logprobs
    n = len(logprobs.tokens)
    assert 0 < n <= 5
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(logprobs.text_offset) == n
    assert "".join(logprobs.tokens) == choice.text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(max(top.values()), lp, abs_tol=1e-4), (token, lp, top)
    # Offsets advance by each token's length.
    for i in range(n - 1):
        assert logprobs.text_offset[i + 1] - logprobs.text_offset[i] == len(logprobs.tokens[i])
    assert response.usage.completion_tokens == n


def test_completion_echo_starts_with_the_prompt(client):
    prompt = "The capital of France is"
    response = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
    )

    choice = response.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    tokens = logprobs.tokens
    joined = ["".join(tokens[: k + 1]) for k in range(len(tokens))]
    assert prompt in joined, f"the tokens start with the prompt's tokens: {tokens}"
    prompt_len = joined.index(prompt) + 1
    assert prompt_len == response.usage.prompt_tokens
    assert len(tokens) == prompt_len + 1
    # The first token has nothing before it to be predicted from.
    assert logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[0] == 0


# Embeddings


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_place_paraphrases_closer_than_unrelated_sentences(client):
    sentences = [
        "A man is playing a guitar on stage.",
        "Someone performs a song on the guitar at a concert.",
        "The central bank raised interest rates again this quarter.",
    ]
    # Without encoding_format the SDK asks for base64 and decodes it.
    response = client.embeddings.create(model=EMBEDDING_MODEL, input=sentences)

    assert response.model == EMBEDDING_MODEL
    assert [d.index for d in response.data] == [0, 1, 2]
    guitar, concert, bank = (d.embedding for d in response.data)
    assert len(guitar) == len(concert) == len(bank) == 384
    assert cosine(guitar, concert) > cosine(guitar, bank) + 0.2
    assert cosine(guitar, concert) > cosine(concert, bank) + 0.2

    floats = client.embeddings.create(
        model=EMBEDDING_MODEL, input=sentences[0], encoding_format="float"
    )
    assert max(abs(x - y) for x, y in zip(floats.data[0].embedding, guitar)) < 1e-6


def test_embeddings_match_sentence_transformers(client):
    reference = json.loads(REFERENCE.read_text())
    items = reference["items"]
    assert len(items) == 3

    response = client.embeddings.create(
        model=EMBEDDING_MODEL, input=[item["text"] for item in items], encoding_format="float"
    )

    for item, data in zip(items, response.data):
        ours = data.embedding
        assert len(ours) == len(item["embedding"]) == 384
        diff = max(abs(x - y) for x, y in zip(ours, item["embedding"]))
        assert diff < 1e-4, f"{diff} for {item['text'][:40]!r}"
    assert response.usage.prompt_tokens == sum(item["tokens"] for item in items)


# Models


def test_models_list_names_the_served_model_and_the_swarm(client):
    ids = [model.id for model in client.models.list()]
    assert MODEL in ids
    # The swarm and every agent that answers users are models too; system agents are not.
    for agent in ["swarm", "coder", "math", "writer", "support", "analyst", "general"]:
        assert agent in ids
    assert "router" not in ids and "verifier" not in ids


# Swarm


def test_swarm_routes_and_accounts_for_every_hop(client):
    raw = client.chat.completions.with_raw_response.create(
        model="swarm",
        messages=[{"role": "user", "content": "Solve for x: 5x - 3 = 12."}],
        temperature=0,
        max_tokens=48,
    )
    response = raw.parse()
    assert raw.headers["x-swarm-agent"] == "math"
    swarm = response.to_dict()["swarm"]
    assert swarm["agent"] == "math" and swarm["route"]["strategy"] == "embedding"
    assert swarm["verdict"]["status"] in ("passed", "failed")
    hops = swarm["usage"]
    assert [h["hop"] for h in hops][:2] == ["route", "generate"]
    assert response.usage.total_tokens == sum(h["total_tokens"] for h in hops)
    assert response.choices[0].message.content


def test_swarm_stream_opens_with_the_agent(client):
    stream = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Solve for x: 2x + 1 = 9."}],
        temperature=0,
        max_tokens=32,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].to_dict()["swarm"]["agent"] == "math"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


# Errors


def test_out_of_range_temperature_is_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, QUESTION, temperature=5, max_tokens=4)

    error = caught.value
    assert error.status_code == 400
    assert error.response.json()["error"]["param"] == "temperature"
    assert error.param == "temperature"
    assert error.type == "invalid_request_error"


def test_wrong_api_key_is_an_authentication_error(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        ask(server.client(api_key="sk-wrong"), QUESTION, max_tokens=4)

    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )

    assert caught.value.status_code == 404
    assert caught.value.code == "model_not_found"


def test_requests_over_the_rate_limit_are_refused_with_retry_after(limited_server):
    client = limited_server.client()
    for _ in range(2):
        ask(client, "Hi", max_tokens=1)

    with pytest.raises(openai.RateLimitError) as caught:
        ask(client, "Hi", max_tokens=1)

    error = caught.value
    assert error.status_code == 429
    assert error.type == "rate_limit_error"
    assert int(error.response.headers["retry-after"]) > 0
