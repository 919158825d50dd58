"""What ``agentjet-client sft`` and ``dpo`` read: JSONL files, refused at the line that is wrong, and the held-out
split, the same for a seed."""

from __future__ import annotations

import json
import random

import pytest

from agentjet_client.errors import InputError
from agentjet_client.finetune.dpo import read_pairs
from agentjet_client.finetune.sft import held_out_split, read_chats


def test_chats_keep_messages_and_tools_and_a_wrong_line_is_named(tmp_path):
    path = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "tools": [], "other": 1}
    path.write_text(json.dumps(chat) + "\n\n" + json.dumps({"messages": []}) + "\n")
    assert read_chats(path) == [{"messages": chat["messages"], "tools": []}, {"messages": []}]
    path.write_text(json.dumps(chat) + "\n{not json\n")
    with pytest.raises(InputError, match=r"chats\.jsonl:2 is not JSON .*one chat per line"):
        read_chats(path)
    path.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(InputError, match=r'chats\.jsonl:1: each line is a chat, an object with "messages"'):
        read_chats(path)
    path.write_text(json.dumps({"messages": "Hi"}) + "\n")
    with pytest.raises(InputError, match='"messages" must be a list'):
        read_chats(path)
    path.write_text("\n")
    with pytest.raises(InputError, match="holds no chat"):
        read_chats(path)
    with pytest.raises(InputError, match="cannot read"):
        read_chats(tmp_path / "missing.jsonl")


def test_a_pair_without_its_rejected_answer_is_refused(tmp_path):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": [{"role": "user", "content": "3?"}], "chosen": "3", "rejected": "8"}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "rejected": None} | {"x": 0}) + "\n")
    assert read_pairs(path)[0] == good
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": good["prompt"], "chosen": "3"}) + "\n")
    with pytest.raises(InputError, match='pair 2 has "chosen" but no "rejected"'):
        read_pairs(path)


def test_the_held_out_part_is_the_same_for_a_seed_and_a_given_one_is_kept():
    records = [{"i": i} for i in range(20)]
    train, held = held_out_split(records, None, 0.25, random.Random(7))
    again = held_out_split(records, None, 0.25, random.Random(7))
    assert (train, held) == again and len(held) == 5 and len(train) == 15
    assert sorted(r["i"] for r in train + held) == list(range(20))
    given = [{"i": 99}]
    train, held = held_out_split(records, given, 0.25, random.Random(7))
    assert held is given and sorted(r["i"] for r in train) == list(range(20))
