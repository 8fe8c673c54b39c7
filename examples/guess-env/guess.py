"""Guess my digit: the environment picked a digit from 0 to 9; the model has three guesses, each answered with
"higher" or "lower". Reward 1 for a hit; nothing otherwise. A policy that ignores the answers hits 1 time in 10
greedily; one that searches (5, then 2 or 7, ...) hits up to 7 times in 10."""

from cloudrl.trainer.rollout.environment import StepResult

PROMPT = "Guess my digit, 0-9: "  # every prompt; the digit is the row's ground_truth


class Guess:
    stop = ["."]  # a model turn ends at "." (besides rollout.stop and end-of-sequence)

    def reset(self, sample: dict) -> str:
        self.target = int(sample["ground_truth"])
        self.low, self.high = 0, 9  # where the digit can still be, from the answers so far
        return ""  # the prompt already asks for the first guess

    def step(self, action_text: str) -> StepResult:
        text = action_text.strip().rstrip(".")
        if len(text) != 1 or not text.isdigit():
            return StepResult(self.ask("one digit"))
        guess = int(text)
        if guess == self.target:
            return StepResult(reward=1.0, done=True)
        if guess < self.target:
            self.low = max(self.low, guess + 1)
            return StepResult(self.ask("higher"))
        self.high = min(self.high, guess - 1)
        return StepResult(self.ask("lower"))

    def ask(self, answer: str) -> str:
        """The answer, then the range the digit is in, ending where the next guess starts."""
        return f" {answer}, {self.low}-{self.high}: "
