"""The router's Ray-free core: the state machine every policy runs under (`core.RouterCore`), the
check of a policy's decision before it changes anything (`plan_check`), and what the core learns
as it runs (`step_overhead`, `lora_residency`). The router actor (`actors/router.py`) wraps it with
I/O; the discrete-event simulator (`load_tests/sim`) drives it directly, importing no Ray code."""
