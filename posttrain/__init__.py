"""posttrain: a staged post-training pipeline reproducing the Kimi K3 recipe
(SFT -> nine RL specialists -> MOPD, with MX QAT throughout)."""

__version__ = "0.1.0"
