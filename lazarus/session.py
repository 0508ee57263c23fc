"""What a training script imports to be recoverable under Lazarus:

    from lazarus.session import TrainingSession

It brings in the trainer's side of the contract only (trainer/sdk/session.py): no temporalio, no
controller, nothing a rank does not need.
"""

from lazarus.trainer.sdk.session import TrainingSession

__all__ = ["TrainingSession"]
