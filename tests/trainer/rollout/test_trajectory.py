"""Trajectories: appended token ids equal a one-shot rendering; collate pads and places rewards."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer.rollout.collate import collate
from trainer.rollout.trajectory import ChatRenderer, Trajectory


def test_appended_turns_equal_the_whole_conversation_rendered_at_once(policy) -> None:
    _, tokenizer = policy
    renderer = ChatRenderer(tokenizer)
    conversation = [
        {
            "role": "user",
            "content": (
                "Let's play Frozen Lake on a 3x3 grid.\n\nP F H\nF F F\nH F G\n\nYour first move?"
            ),
        },
        {"role": "assistant", "content": "down"},
        {"role": "user", "content": "You moved down.\n\nS F H\nP F F\nH F G\n\nYour next move?"},
        {"role": "assistant", "content": "right"},
        {"role": "user", "content": "You moved right.\n\nS F H\nF P F\nH F G\n\nYour next move?"},
    ]
    ids = renderer.prompt(conversation[:1])
    ids += renderer.answer("down") + renderer.continuation(conversation[2:3], stopped_on_eos=True)
    ids += renderer.answer("right") + renderer.continuation(conversation[4:5], stopped_on_eos=True)
    whole = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer.encode(whole, add_special_tokens=False)
    # a turn cut off by the token limit (no EOS generated) gets the EOS as context
    assert (
        renderer.continuation(conversation[2:3], stopped_on_eos=False)[0] == tokenizer.eos_token_id
    )


def test_collate_pads_right_and_puts_turn_rewards_on_the_last_policy_token() -> None:
    a = Trajectory("e", 0, group_id=3)
    a.append_context([10, 11])
    a.append_policy([12, 13], [-0.5, -0.25])
    a.end_turn(0.5)
    a.append_context([14])
    a.append_policy([15], [-1.0])
    a.end_turn(1.0)
    a.final_reward = 2.0
    b = Trajectory("e", 1, group_id=4)
    b.append_context([20])
    b.append_policy([21], [-0.1])
    b.end_turn(-0.1)
    batch = collate([a, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 13, 14, 15], [20, 21, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]]
    assert batch["old_logprobs"][0].tolist() == [0, 0, -0.5, -0.25, 0, -1.0]
    # turn 1 reward at t=3 (its last policy token); turn 2 reward + final reward at t=5
    assert batch["token_rewards"][0].tolist() == [0, 0, 0, 0.5, 0, 3.0]
    assert batch["scores"].tolist() == [3.5, pytest.approx(-0.1)]
    assert batch["group_ids"].tolist() == [3, 4]
    with pytest.raises(ValueError, match="2 generated tokens but 1 log-probs"):
        a.append_policy([1, 2], [0.0])
    b.turn_rewards.append(1.0)  # a reward with no turn end: refused, naming the fix
    with pytest.raises(ValueError, match=r"2 turn rewards for 1 turn ends; .*end_turn"):
        collate([a, b], pad_token_id=0)
    b.turn_rewards.pop()
    b.response_mask = [0.0, 1.0]  # a hand-built mask of floats collates as its ints did
    floats = collate([a, b], pad_token_id=0)["response_mask"]
    assert floats.tolist() == batch["response_mask"].tolist()
    b.response_mask = [0, 0.5]  # ... but no mask is ever rounded
    with pytest.raises(ValueError, match=r"response_mask holds 0.5; .*append_policy"):
        collate([a, b], pad_token_id=0)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Your move?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2 + 2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "calculate", "arguments": {"expression": "2 + 2"}}}
            ],
        },
        {"role": "tool", "content": "4"},
    ],
]


def test_the_renderers_direct_paths_give_the_tokenizers_own_output(policy) -> None:
    """The renderer renders the compiled template and encodes/decodes with the Rust tokenizer
    directly (the driver does it once per turn); what comes out is transformers' own."""
    _, tokenizer = policy
    renderer = ChatRenderer(tokenizer)
    assert renderer._fast.backend is not None and renderer._fast.decodes
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            for prompt in (False, True):
                extra = {"tools": tools} if tools else {}
                expected = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=prompt, tokenize=False, **extra
                )
                assert renderer._render(messages, prompt, tools) == expected
                ids = tokenizer.encode(expected, add_special_tokens=False)
                assert renderer.encode(expected) == ids
                assert renderer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_truncates_on_its_own_keeps_transformers_encode(policy) -> None:
    import copy

    _, tokenizer = policy
    truncating = copy.deepcopy(tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=4)
    renderer = ChatRenderer(truncating)
    assert renderer._fast.backend is None  # its own truncation would apply to the direct path
    text = "Digits 1 2 3 4 5 6 7 8 9"  # each digit is a token of its own
    assert renderer.encode(text) == truncating.encode(text, add_special_tokens=False)
    assert len(renderer.encode(text)) > 4


def test_collate_reads_trajectories_from_env_workers_without_unpacking_their_lists() -> None:
    """A training batch of episodes that came packed from env workers becomes the same tensors
    as the episodes themselves, without one Python object per token on the driver."""
    import pickle

    from trainer.rollout.wire import trajectory_from_wire, trajectory_to_wire

    episode = Trajectory("e", 0, group_id=3)
    episode.append_context([10, 11])
    episode.append_policy([12, 13], [-0.5, -0.25], version=2)
    episode.end_turn(0.5)
    turns = Trajectory("e", 1, group_id=3)
    for turn in range(2):
        sample = turns.turn_sample([20, 21 + turn])
        sample.append_policy([30 + turn], [-0.125], version=1)
        sample.end_turn(1.0)
        turns.samples.append(sample)
    turns.turn_rewards = [1.0, 1.0]
    expected = collate([episode, turns], pad_token_id=0)

    arrived = [
        trajectory_from_wire(pickle.loads(pickle.dumps(trajectory_to_wire(t))))
        for t in (episode, turns)
    ]
    batch = collate(arrived, pad_token_id=0)
    for name, tensor in expected.items():
        assert batch[name].dtype == tensor.dtype and batch[name].tolist() == tensor.tolist(), name
    rows = [arrived[0], *arrived[1].samples]
    unpacked = [
        n for row in rows for n in ("token_ids", "logprobs", "response_mask") if n in vars(row)
    ]
    assert unpacked == []
