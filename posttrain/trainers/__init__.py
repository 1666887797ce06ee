"""The built-in stage kinds' training loops (sft, rl, mopd), each on accelerate.

Importing this package registers them in posttrain.stages.STAGE_KINDS (posttrain.registry lists it
among the built-in plug-ins); `common` holds what the loops share (model loading, optimiser,
schedule, accelerate setup, exact-resume checkpoints).
"""

from posttrain.trainers import mopd, rl, sft

__all__ = ["mopd", "rl", "sft"]
