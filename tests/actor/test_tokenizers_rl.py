"""Agent rollouts on real tokenizers: turns rendered by the checkpoint's chat template, tool calls
that parse, and a length penalty that counts the tokenizer's own tokens by kind."""

import numpy as np
import pytest

from composer_jax import envs
from composer_jax.actor.ledger import GroupLedger
from composer_jax.actor.samples import group_sequences, groups_to_batch
from composer_jax.actor.thread_pool import ThreadEnvironmentPool
from composer_jax.agent.kinds import TURN_END_MARKERS, token_kinds, turn_sampling
from composer_jax.config import AgentConfig, ModelConfig, RLConfig, RolloutConfig
from composer_jax.data import load_tokenizer
from composer_jax.data.chat import chat_format_for
from composer_jax.infer import SamplingParams
from composer_jax.rl import SegmentKind
from composer_jax.rl.length_penalty import LENGTH_FEATURES, length_features
from tests.actor.scripted import ScriptedSampler, make_coordinator
from tests.data.helpers import make_hf_folder, make_tiktoken_folder

MODEL_CFG = ModelConfig()
THINK = "<think>write the function, then finish</think>\n"


def _tokenizer(kind, folder):
    if kind == "bpe_chatml":
        make_hf_folder(folder)
    elif kind == "bpe_generic":
        make_hf_folder(folder, chat_template=None)
    else:
        make_tiktoken_folder(folder)
    return load_tokenizer(str(folder))


@pytest.mark.parametrize("kind", ["bpe_chatml", "bpe_generic", "tiktoken_kimi"])
def test_rollout_parses_calls_and_counts_tokens_by_kind(tmp_path, kind):
    tokenizer = _tokenizer(kind, tmp_path / "tok")
    chat = chat_format_for(tokenizer)
    task = envs.builtin_tasks(1, seed=5, max_ops=1)[0]
    write, final = envs.oracle_turns(task)
    turns = [THINK + write, final]
    sampler = ScriptedSampler(
        lambda prompt, turn: turns[turn],
        tokenizer,
        moe_layers=MODEL_CFG.num_moe_layers,
        k=MODEL_CFG.num_experts_per_tok,
    )
    cfg = RLConfig(
        rollout=RolloutConfig(group_size=2, groups_per_step=1, context_len=1024),
        agent=AgentConfig(max_turns=4),
    )
    ledger = GroupLedger(tmp_path / "ledger")
    with ThreadEnvironmentPool(2, timeout_s=60) as pool:
        coordinator = make_coordinator(cfg, sampler, pool, ledger, [("p0", task)], tokenizer)
        coordinator.start()
        try:
            assert coordinator.wait_for_groups(1, timeout_s=120) == ["p0"]
        finally:
            coordinator.stop()
    group = ledger.load("p0")
    # The call parsed and ran: the oracle's file was written and the hidden tests pass.
    np.testing.assert_array_equal(group.rewards, [1.0, 1.0])
    np.testing.assert_array_equal(group.arrays["num_tool_calls"], [1, 1])
    np.testing.assert_array_equal(group.arrays["num_turns"], [2, 2])

    call = envs.parse_turn(write).calls[0].text
    want = {}
    with envs.Episode(task) as episode:
        prompt = chat.prompt(episode.prompt)
    for index, seq in enumerate(group_sequences(group)):
        assert seq.tokens[: len(prompt)].tolist() == prompt

        def text_of(kind, policy=True):
            hit = (seq.kinds == kind) & (seq.policy_mask == policy)
            return tokenizer.decode(seq.tokens[hit]), int(hit.sum())

        thinking, n_thinking = text_of(SegmentKind.THINKING)
        calls, n_calls = text_of(SegmentKind.TOOL_CALL)
        finals, n_final = text_of(SegmentKind.FINAL_MESSAGE)
        outputs, n_output = text_of(SegmentKind.TOOL_OUTPUT, policy=False)
        assert calls == call and thinking == THINK and finals == final
        # Tool output is the environment's reply, tokenized on its own (the template's
        # scaffolding around it is prompt, not tool output).
        observation = outputs.strip("\n") if kind == "bpe_generic" else outputs
        assert observation.startswith('<output tool="write_file">')
        if kind != "bpe_generic":
            assert n_output == tokenizer.count_tokens(observation)
        assert n_thinking + n_calls + n_final == int(seq.policy_mask.sum())
        want[index] = [n_thinking, n_calls, n_output, n_final, 0, 1, 2]
    batch = groups_to_batch([group], 1024)
    features = np.asarray(length_features(batch))
    assert LENGTH_FEATURES == (
        "thinking",
        "tool_call",
        "tool_output",
        "final_message",
        "summary",
        "tool_calls",
        "turns",
    )
    for index, counts in want.items():
        np.testing.assert_array_equal(features[index], counts)


def test_token_kinds_follow_the_text_whatever_the_tokenization(tmp_path):
    tokenizer = _tokenizer("tiktoken_kimi", tmp_path / "tok")
    turn = 'hmm<think>é中</think><call tool="x"><arg name="a">1</arg></call><final>ok</final>'
    ids = tokenizer.encode(turn)
    kinds = token_kinds(ids, tokenizer)
    pieces = tokenizer.token_texts(ids)
    by_kind = {
        k: "".join(p for p, kind in zip(pieces, kinds) if kind == k)
        for k in (SegmentKind.THINKING, SegmentKind.TOOL_CALL, SegmentKind.FINAL_MESSAGE)
    }
    assert by_kind[SegmentKind.THINKING] == "hmm<think>é中</think>"
    assert by_kind[SegmentKind.TOOL_CALL] == '<call tool="x"><arg name="a">1</arg></call>'
    assert by_kind[SegmentKind.FINAL_MESSAGE] == "<final>ok</final>"


def test_turn_sampling_stops_at_markers_and_end_of_turn(tmp_path):
    tokenizer = _tokenizer("bpe_chatml", tmp_path / "tok")
    params = turn_sampling(SamplingParams(max_new_tokens=9), chat_format_for(tokenizer))
    assert params.stop_strings == TURN_END_MARKERS and params.tokenizer == tokenizer.spec
    assert params.stop_sequences == ((tokenizer.eos_id,), (tokenizer.token_id("<|im_end|>"),))
    assert params.max_new_tokens == 9
