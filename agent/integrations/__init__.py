"""Framework integrations for the trainvitals agent (optional extras).

Each submodule imports its framework at import time, so import only the one you use::

    from trainvitals.agent.integrations.hf import TrainvitalsCallback  # transformers Trainer
    from trainvitals.agent.integrations.lightning import TrainvitalsLightningCallback  # Lightning

This package itself imports nothing, so `import trainvitals.agent` never pulls in a framework.
"""
