"""Guess my digit with a tool: the model asks `check(digit)` as often as it likes (each call answered "higher",
"lower" or "right"), then answers with the digit (a turn without a call). Reward 1 for a right answer, 0.1 less
per call after the first. The tool needs the episode's digit, so the tools are built in `reset`: a class-level
`tools` is shared by every episode, one built in `reset` belongs to its episode."""

from cloudrl.trainer.rollout.tool_calls import ToolEnvironment, tool_schema

CHECK = tool_schema("check", "Compares a digit with mine.", {"digit": {"type": "integer"}})


class GuessWithTool(ToolEnvironment):
    def reset(self, sample: dict) -> str:
        self.target = int(sample["ground_truth"])
        self.calls = 0
        self.tools = {"check": (CHECK, self.check)}  # this episode's tool, bound to its digit
        return super().reset(sample)

    def check(self, digit: int) -> str:
        self.calls += 1
        digit = int(digit)  # a call with "7" counts as 7; "seven" is answered with the ValueError
        if digit == self.target:
            return "right"
        return "higher" if digit < self.target else "lower"

    def score(self, sample: dict, answer: str) -> float:  # the turn without a call ends the episode
        right = answer.strip().rstrip(".") == str(self.target)
        return float(right) - 0.1 * max(self.calls - 1, 0)
