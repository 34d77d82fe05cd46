"""Reward models: images or latents in, scores out (installed as ``flowalign.reward_models``)."""
