"""Built-in agent tasks: environments with tools, their data and the warm-ups that make them learnable by the
built-in tiny model on CPU. They sit above rollout/ and inputs/ (whose environment and tool-call interfaces they
use); nothing below imports them: a config names one (`rollout.environment=cloudrl.trainer.agents.MODULE:CLASS`)."""
