"""The device program: what runs on the mesh each step (the runner, the layer loop, attention, MoE, the
pipeline stages, the KV pool). It imports no host module: it knows a step only by jaxinfer.step's arrays."""
