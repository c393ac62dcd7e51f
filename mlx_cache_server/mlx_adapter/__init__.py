"""The one seam to mlx-lm's and MLX's internals: everything of ours that reads or sets a
private name of theirs, owns a step of theirs, or changes one of their objects in place.

The lowest layer of the package: it imports mlx, mlx-lm and the standard library only,
and the cache library (`prompt_cache`), `runtime` and `engine` import it. What it relies on
in mlx-lm, it names in tests/unit/test_mlx_adapter.py (the private attributes it reads,
the step it rewrites, the defect it corrects), so that a new mlx-lm release is a port of
this folder whose breakage a test names; pyproject.toml pins the release line checked.

- `stepping`: `BatchGenerator` with a step of our own, its model calls overridable.
- `streams`: the state of a generation batch a step of ours reads and sets.
- `windows`: rotating windows put in the order of their tokens.
- `batch_cache`: a `BatchKVCache` over buffers we filled.
- `gapped_cache`: a batch's KV cache with positions no query attends to.
- `last_logits`: logits of some positions, the model's head given only those.
- `hub`: a model's folder, fetched from the hub when it is not on this machine.
- `model_patches`: the CPU fast path's changes to one model's modules and to mlx-lm's
  generator module's `mx` (tests/unit/test_mlx_adapter_models.py).
"""
