"""Forward modes: the ways a worker runs one group's denoiser forward, each with the state it
keeps per request (`base.ForwardMode`). The step runner holds its modes in the order
`registry.forward_modes` gives and runs each group through the first that takes it."""
