"""trainvitals agent: attach to a training job in two lines.

    import trainvitals.agent as tv
    agent = tv.attach(model, optimizer, run="gpt-7b-0412")   # once
    agent.step(loss=loss, tokens=n_tokens)                    # once per optimizer step

Imports torch and pydantic only. TRAINVITALS_DISABLE=1 makes attach() return a no-op; either
way the result is a `TrainingAgent`.
"""

from trainvitals.agent._agent import Agent, NoopAgent, attach
from trainvitals.agent._config import AgentConfig
from trainvitals.agent._protocol import TrainingAgent

__all__ = ["Agent", "AgentConfig", "NoopAgent", "TrainingAgent", "attach"]
