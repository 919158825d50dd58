"""A verifiers environment as the Environments Hub packages them: a module with ``load_environment``. Nothing
in it knows about AgentJet. Each row asks for one digit; the environment answers every reply with the next
word to write (five on, wrapping), three model turns in all; the rubric scores the share written right.

    import verifiers as vf
    env = vf.load_environment("countdown_env", digits="3,8")
"""

import verifiers as vf
from datasets import Dataset

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TURNS = 3


def ask(digit: int) -> str:
    return f"Write {WORDS[digit]} as a digit."


class Countdown(vf.MultiTurnEnv):
    """The environment's side of the protocol: after each reply, the next word to write."""

    async def env_response(self, messages, state, **kwargs):
        asked = state.setdefault("asked", [int(state["answer"])])
        asked.append((asked[-1] + 5) % 10)
        return [vf.UserMessage(content=ask(asked[-1]))]


def right_share(completion, state) -> float:
    """The share of the three replies that wrote the digit asked for."""
    replies = [m["content"].strip() for m in completion if m["role"] == "assistant"]
    asked = state.get("asked", [int(state["answer"])])
    return sum(reply == str(digit) for reply, digit in zip(replies, asked, strict=False)) / TURNS


def load_environment(digits: str = "0,1,2,3,4,5,6,7,8,9") -> vf.Environment:
    rows = [{"prompt": [{"role": "user", "content": ask(int(d))}], "answer": d} for d in digits.split(",")]
    return Countdown(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[right_share]), max_turns=TURNS)
