"""The `rl` stage's rewards beyond a task family's own verifier: the budget reward that teaches
reasoning effort (budget.py) and the length-capped generative reward model (genrm.py), each whole
in its module. The MOPD log-ratio reward is a tensor function in posttrain.algos.mopd_reward.
"""
