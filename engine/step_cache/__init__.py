"""Step caching per request inside a continuous batch (First-Block Cache, `first_block`): each
request decides at each step, from how far its own first block's output moved since its last
computed step, whether to run the model's later blocks or reuse what they gave it then."""
