"""Add-on modes: the ways a request's add-ons (ControlNet residuals, LoRAs) reach whichever
forward runs its step, each with the state it keeps per request (`base.AddonMode`). The step
runner holds the modes `registry.addon_modes` gives; unlike forward modes, every one of them
sees every member of every forward."""
