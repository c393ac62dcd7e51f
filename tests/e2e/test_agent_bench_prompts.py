"""`python -m bench agent` gives mlx_lm.server, as chat messages, the prompt our server
renders for a Claude Code or Codex turn (`bench/agent.py: chat_messages`): the two servers
must prefill the same tokens, or the TTFT ratio compares different work. Here our live
server (the default model's tokenizer and template, which knows no tools) is asked both
requests, and its prompt's length must equal the template's rendering of the peer's
messages."""

from __future__ import annotations

import pytest
from anthropic import Anthropic
from openai import OpenAI
from transformers import AutoTokenizer


@pytest.fixture
def agent(bench_script):
    return bench_script("agent")


def test_the_peer_is_given_the_prompt_our_server_renders(agent, agent_server):
    url, log = agent_server
    tokenizer = AutoTokenizer.from_pretrained(str(log.parent / "model"))
    system = agent.system_text(120)
    session = agent.script(0, 6, 30)
    upto = 6  # five results, one of them followed by a user's words (turn 4)
    assert any(turn["user"] for turn in session.turns[:upto])

    peer = agent.chat_messages(system, None, session, upto)
    peer_length = len(tokenizer.apply_chat_template(peer, add_generation_prompt=True,
                                                    return_dict=False))  # fmt: skip

    messages = Anthropic(base_url=url, api_key="x", max_retries=0).messages.create(
        model="claude-sonnet-4-6", max_tokens=1, extra_body={"temperature": 0},
        **agent.anthropic_request(system, None, session, upto),
    )  # fmt: skip
    usage = messages.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == peer_length

    response = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).responses.create(
        model="bench", max_output_tokens=16, temperature=0,
        **agent.responses_request(system, session, upto),
    )  # fmt: skip
    assert response.usage.input_tokens == peer_length
