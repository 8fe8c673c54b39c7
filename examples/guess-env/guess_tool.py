"""Guess my digit, played with a tool: each guess is a call to `guess(digit)`, answered "higher", "lower" or
"right". A right guess ends the episode with reward 1; a turn without a call gives up (reward 0); at most
rollout.max_turns calls. The tool needs the episode's digit, so the tools are built in `reset`: a class-level
`tools` is shared by every episode, one built in `reset` belongs to its episode."""

from cloudrl.trainer.rollout.environment import StepResult
from cloudrl.trainer.rollout.tool_calls import ToolEnvironment, tool_schema

GUESS = tool_schema("guess", "Guesses my digit: higher, lower or right.", {"digit": {"type": "integer"}})


class GuessWithTool(ToolEnvironment):
    def reset(self, sample: dict) -> str:
        self.target = int(sample["ground_truth"])
        self.found = False
        self.tools = {"guess": (GUESS, self.guess)}  # this episode's tool, bound to its digit
        return super().reset(sample)

    def guess(self, digit: int) -> str:
        digit = int(digit)  # a call with "7" counts as 7; "seven" is answered with the ValueError
        if digit == self.target:
            self.found = True
            return "right"
        return "higher" if digit < self.target else "lower"

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if self.found:  # the tool ends the episode: reward 1, no observation after it
            return StepResult(reward=1.0, done=True, info=result.info)
        return result

    def score(self, sample: dict, answer: str) -> float:  # a turn without a call: the model gave up
        return 0.0
