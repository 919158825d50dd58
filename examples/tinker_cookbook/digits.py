"""The tinker-cookbook's own training loops against an AgentJet server: ``supervised.train`` over a JSONL
file of chats, and ``rl.train`` on the demo's digits task (``Write seven as a digit.`` -> ``7``, reward 1 for
the right digit) with an RL dataset of ours, unchanged but for ``base_url``, the model name and the
registered tokenizer and renderer (``agentjet_client.finetune.cookbook.register``).

    agentjet-server up                                    # the embedded tiny model
    python examples/tinker_cookbook/digits.py rl --seed 0 --log-path /tmp/digits-rl
    python examples/tinker_cookbook/digits.py sft --log-path /tmp/digits-sft

Needs ``pip install tinker-cookbook`` (see docs/tinker.md for installing it where ``tml-renderers`` is not
available) and ``TINKER_API_KEY=tml-<a key of the server>`` (``tml-local`` for a server without keys).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Sequence
from pathlib import Path

import chz
from tinker_cookbook import renderers
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from agentjet_client.finetune.cookbook import register

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class DigitEnv(ProblemEnv):
    def __init__(self, renderer: renderers.Renderer, digit: int) -> None:
        super().__init__(renderer, format_coef=0.0)  # the reward is the answer alone, as in the demo
        self.digit = digit

    def get_question(self) -> str:
        return f"Write {WORDS[self.digit]} as a digit."

    def check_answer(self, sample_str: str) -> bool:
        return sample_str.strip() == str(self.digit)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return str(self.digit)


class DigitsDataset(RLDataset):
    def __init__(self, builder: DigitsBuilder) -> None:
        self.builder = builder
        self.order = random.Random(builder.seed)

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        renderer = renderers.get_renderer(self.builder.renderer_name, get_tokenizer(self.builder.model_name))
        digits = [self.order.choice(self.builder.digits) for _ in range(self.builder.groups_per_batch)]
        return [
            ProblemGroupBuilder(lambda d=d: DigitEnv(renderer, d), self.builder.group_size, "digits") for d in digits
        ]

    def __len__(self) -> int:
        return self.builder.batches


@chz.chz
class DigitsBuilder(RLDatasetBuilder):
    model_name: str
    renderer_name: str
    digits: tuple[int, ...] = tuple(range(10))
    groups_per_batch: int = 16
    group_size: int = 8
    batches: int = 60
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return DigitsDataset(self), None


def rl_config(url: str, log_path: Path, seed: int, batches: int, digits: tuple[int, ...], lr: float):  # type: ignore[no-untyped-def]
    from tinker_cookbook.rl import train

    names = register(url)
    builder = DigitsBuilder(
        model_name=names.model, renderer_name=names.renderer, digits=digits, batches=batches, seed=seed
    )
    return train.Config(
        learning_rate=lr,
        dataset_builder=builder,
        model_name=names.model,
        renderer_name=names.renderer,
        recipe_name="agentjet-digits",
        max_tokens=4,
        log_path=str(log_path),
        base_url=names.base_url,
        loss_fn="stable_reinforce",  # the cookbook's default for off-policy data; the server checks provenance
        lora_rank=32,
        eval_every=0,
        save_every=0,
        num_groups_to_log=0,
        rollout_json_export=False,
    )


def sft_config(url: str, log_path: Path, lr: float):  # type: ignore[no-untyped-def]
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    names = register(url)
    log_path.mkdir(parents=True, exist_ok=True)
    chats = log_path / "chats.jsonl"
    with chats.open("w") as out:  # a reply in a fixed form around the digit, the form what SFT teaches fast
        for _ in range(4):
            for digit, word in enumerate(WORDS):
                ask = {"role": "user", "content": f"Spell out how {word} is written."}
                reply = {"role": "assistant", "content": f"The word {word} is written as the digit {digit}."}
                out.write(json.dumps({"messages": [ask, reply]}) + "\n")
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=names.model, renderer_name=names.renderer, max_length=256, batch_size=8
    )
    return train.Config(
        log_path=str(log_path / "log"),
        model_name=names.model,
        renderer_name=names.renderer,
        dataset_builder=FromConversationFileBuilder(file_path=str(chats), test_size=8, common_config=common),
        learning_rate=lr,
        lora_rank=16,
        base_url=names.base_url,
        num_epochs=3,
        save_every=0,
        eval_every=5,
        recipe_name="agentjet-digits-sft",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("loop", choices=["rl", "sft"])
    parser.add_argument("--server", default="http://127.0.0.1:8000")
    parser.add_argument("--log-path", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--digits", default="0,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--lr", type=float)
    args = parser.parse_args()
    if args.loop == "rl":
        from tinker_cookbook.rl import train as rl_train

        digits = tuple(int(d) for d in args.digits.split(","))
        config = rl_config(args.server, args.log_path, args.seed, args.batches, digits, args.lr or 2e-3)
        asyncio.run(rl_train.main(config))
    else:
        from tinker_cookbook.supervised import train as sft_train

        asyncio.run(sft_train.main(sft_config(args.server, args.log_path, args.lr or 1e-2)))


if __name__ == "__main__":
    main()
