"""The built-in stage kinds' training loops (sft, and the RL and MOPD trainers), each on accelerate.

Importing this package registers them in posttrain.stages.STAGE_KINDS; `common` holds what the
loops share (model loading, optimiser, schedule, accelerate setup, exact-resume checkpoints).
"""

from posttrain.trainers import rl, sft

__all__ = ["rl", "sft"]
