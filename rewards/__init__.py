"""Reward plug-ins: budget reward, length-capped GenRM, verifiers, MOPD log-ratio reward."""
