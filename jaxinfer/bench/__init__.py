"""Measurements: `python -m jaxinfer.bench` (decode and prefill, the default), and one module per question,
each run as `python -m jaxinfer.bench.<name>`: attention, pipeline, sequence, serving, startup, sampler,
gpu_check, gpu_compile (a GPU's decode step compiled without one); op_profile and xla_floor serve the
decode benchmark."""
