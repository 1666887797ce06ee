"""posttrain: a staged post-training pipeline reproducing the Kimi K3 recipe (SFT -> RL specialists -> MOPD)."""

__version__ = "0.1.0"
