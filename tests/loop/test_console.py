"""What the job log shows besides the metrics: one sampled prompt, response and reward on step 1 and every
`trainer.sample_every` steps after (metrics.print_sample), and the key's checks."""

from __future__ import annotations

import pytest
from cloudrl.trainer.config import ConfigError, load_config
from cloudrl.trainer.metrics import print_sample


class CountingTokenizer:
    """Decodes ids as text and counts its calls: a step that prints nothing must decode nothing."""

    def __init__(self):
        self.calls = 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return " ".join(str(i) for i in ids)


@pytest.mark.parametrize(("every", "shown"), [(50, [1, 51, 101]), (3, [1, 4, 7, 10]), (1, list(range(1, 11))), (0, [])])
def test_a_sample_is_printed_on_step_1_and_every_n_steps_after(capsys, every, shown):
    tokenizer = CountingTokenizer()
    for step in range(1, 102 if every == 50 else 11):
        print_sample(step, every, "2+3=", tokenizer, [5], 1.0)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["sample: prompt '2+3=' -> response '5', reward 1"] * len(shown)
    assert tokenizer.calls == len(shown)


def test_sample_every_is_a_checked_key():
    assert load_config("local").trainer.sample_every == 50
    assert load_config("local", ["trainer.sample_every=0"]).trainer.sample_every == 0
    with pytest.raises(ConfigError, match="trainer.sample_every"):
        load_config("local", ["trainer.sample_every=-1"])


def test_a_multi_turn_sample_shows_its_turns_apart(capsys):
    """A multi-turn episode's observations (loss mask 0) are shown after `| env`, the model's turns as they are:
    which text the model wrote and which the environment answered can be told apart."""
    tokenizer = CountingTokenizer()
    ids, mask = [5, 7, 8, 9, 6], [1, 0, 0, 1, 1]
    print_sample(1, 50, "Guess: ", tokenizer, ids, 1.0, mask)
    assert capsys.readouterr().out.strip() == "sample: prompt 'Guess: ' -> response '5' | env '7 8' | '9 6', reward 1"
    assert tokenizer.calls == 3
    print_sample(1, 50, "2+3=", tokenizer, [5], 0.0, [1])  # one turn: shown whole, as before
    assert capsys.readouterr().out.strip() == "sample: prompt '2+3=' -> response '5', reward 0"
