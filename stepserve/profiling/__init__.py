"""`stepserve profile`: measure, on this device, the latencies a cost model is fitted from.

What is measured, each the median of interleaved repeats after a warm-up:

- denoise: one `family.denoise` forward per (resolution, batch rows); CFG on and off are covered
  by the rows they produce (a CFG request is 2 rows, so both settings meet at even rows, which
  are measured once).
- denoise with mask_ratio < 1 (where the family edits with cached activations): the forward the
  workers serve for a batch of edits of templates they hold a record of, at the grid's mask
  ratios, per resolution and number of edits (`masked_batches`); see profiling/edits.py.
- block_cached, block_full, block_load (the same families and grid): each cache slot's costs in
  such a forward over a record of block outputs, what the workers' loading DP plans with; see
  profiling/edit_blocks.py.
- denoise of several resolutions (where the family runs them in one forward): that forward for
  every mix of the grid's sizes, with `packed_batches` requests of each, timed beside the same
  groups run in turn; see profiling/packed.py.
- round_overhead, per group: `StepRunner.execute(plan)` wall time minus the time spent inside
  `family.denoise` during that very call (the family is wrapped to time its forwards), i.e.
  the sampler bookkeeping a round adds around the forward.
- round_overhead, fixed: what the live loop adds around a worker round (the live per-step
  latency minus the in-process round: the forward and the bookkeeping above); without the live
  app, a bare Ray actor round trip carrying a `WorkerPlan` for a full batch and answering a
  `StepReport`, as the router does with a worker every round.
- text_encode: `family.encode_text` for 1, 2, 4, ... texts.
- vae_decode: `family.decode` of one latent plus `encode_png`, per resolution.
- host_probe (CPU only): one fixed forward (the smallest size, one CFG request) timed alone and
  with 1, 2, ... copies running beside it in sibling processes, up to one per core, the
  modes interleaved: how much busy cores slow each other on this host (shared caches, memory
  bandwidth, a VM's hyperthread-sibling vCPUs). The simulator charges it when the whole app
  shares one CPU box.
- request_overhead (unless --no-live): the config's real app on a lean local Ray, solo HTTP
  requests with two step counts; the latency line's intercept minus the measured text-encode
  and decode is what a request pays beyond its model work (HTTP, Serve and Ray hops, the
  text-encoder batch wait, admission).
- host_idle and router_cpu (with the live requests, where /proc shows the app's processes): the
  CPU this whole machine burns per second while the warm app sits idle (IDLE_S seconds), and
  the router process's CPU per denoising step (the slope of its CPU per solo request over the
  two step counts). Neither is on a request's path; the simulator charges both to a shared CPU
  host, where they take cores from the workers.

Threads follow the config: the denoiser with `workers.torch_threads`, the encoder and decoder
with their own, so the numbers are what each deployment would see.

Modules: `images` (the command, `run_profile`, and the model's own work), `live` (Ray and the
live app), `addons`, `edits`, `edit_blocks`, `packed`, `video` (each one kind of row, or a video model's whole
profile), and `common`, the helpers they all share (none of them imports another's helpers).
"""
