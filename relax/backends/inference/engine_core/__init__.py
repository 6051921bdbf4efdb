"""The embedded engine's core: a paged KV cache, a continuous-batching scheduler and a model runner.

- `block_manager`: the KV pool as fixed-size blocks, block tables per sequence, prompt blocks shared by hash
  (a GRPO group's samples share their prompt's blocks), refcounts;
- `scheduler`: admits prefills within a token budget between decode steps; requests join and leave at step
  boundaries (continuous batching); preempts the youngest sequence when blocks run out;
- `attention`: attention over the block pool (a Triton decode kernel on CUDA, torch on every device);
- `decoder`: the forward of the supported text decoders over the Hugging Face model's own modules and weights;
- `media`: a multimodal prompt's merged embeddings, 3D rope and block keys (Qwen-VL, Qwen2.5-Omni);
- `sampler`: sampling on the device, with noise that depends on a request's seed and position only;
- `step_runner`: what the runners share (a step's output, sampling, decode inputs);
- `paged_runner`: the KV pool tensors, prefill over packed sequences, decode over block tables, CUDA graphs per
  batch-size bucket;
- `cache_runner`: steps by the model's own forward and cache, for the families the decoder does not run;
- `engine_core`: the step loop behind `EmbeddedEngine.generate`.
"""
