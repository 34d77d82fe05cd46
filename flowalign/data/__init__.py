"""Training data: the prompts each iteration draws (``prompts``) and image-caption datasets for objectives."""
